package deadletter

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

var errTooLarge = errors.New("too large")

func isTooLarge(err error) bool { return errors.Is(err, errTooLarge) }

// TestPublishesGoTogether: publishes to a topic overlap; one that does not
// return holds up no other.
func TestPublishesGoTogether(t *testing.T) {
	var topics Topics
	stuck := make(chan struct{})
	defer close(stuck)
	started := make(chan struct{})
	go topics.Publish(context.Background(), "dlq", func(context.Context) error {
		close(started)
		<-stuck
		return nil
	}, isTooLarge)
	<-started
	done := make(chan error, 1)
	go func() {
		done <- topics.Publish(context.Background(), "dlq", func(context.Context) error { return nil }, isTooLarge)
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a publish waits for another in flight to the same topic")
	}
}

// TestTooLargeIsTriedAlone: a publish refused as too large is tried again
// with no other publish to its topic in flight, and the second answer
// stands; publishes to other topics go on.
func TestTooLargeIsTriedAlone(t *testing.T) {
	var topics Topics
	var inFlight, most atomic.Int32
	var calls atomic.Int32
	publish := func(first error) func(context.Context) error {
		var n atomic.Int32
		return func(context.Context) error {
			calls.Add(1)
			cur := inFlight.Add(1)
			defer inFlight.Add(-1)
			if n.Add(1) == 1 {
				time.Sleep(20 * time.Millisecond) // overlap the others
				return first
			}
			if cur > 1 {
				most.Store(cur)
			}
			time.Sleep(5 * time.Millisecond)
			return nil
		}
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := topics.Publish(context.Background(), "dlq", publish(errTooLarge), isTooLarge); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if calls.Load() != 16 {
		t.Errorf("%d publishes, want 16: each refused once, then alone", calls.Load())
	}
	if m := most.Load(); m != 0 {
		t.Errorf("a retry alone ran with %d publishes in flight", m)
	}

	stillTooLarge := func(context.Context) error { return errTooLarge }
	if err := topics.Publish(context.Background(), "dlq", stillTooLarge, isTooLarge); !errors.Is(err, errTooLarge) {
		t.Errorf("too large alone: %v, want the publish's error", err)
	}
	other := errors.New("other")
	n := 0
	err := topics.Publish(context.Background(), "dlq", func(context.Context) error { n++; return other }, isTooLarge)
	if !errors.Is(err, other) || n != 1 {
		t.Errorf("another error: %v after %d publishes, want it after 1", err, n)
	}
}

// TestWaitAloneEndsWithContext: a retry alone waiting for a publish that
// does not return gives up with its context.
func TestWaitAloneEndsWithContext(t *testing.T) {
	var topics Topics
	stuck := make(chan struct{})
	defer close(stuck)
	started := make(chan struct{})
	go topics.Publish(context.Background(), "dlq", func(context.Context) error {
		close(started)
		<-stuck
		return nil
	}, isTooLarge)
	<-started
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := topics.Publish(ctx, "dlq", func(context.Context) error { return errTooLarge }, isTooLarge)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want the context's error", err)
	}
	// The topic is open again to publishes together.
	if err := topics.Publish(context.Background(), "dlq", func(context.Context) error { return nil }, isTooLarge); err != nil {
		t.Fatal(err)
	}
}
