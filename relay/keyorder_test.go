package relay_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// failOncePublisher fails the first attempt of one value and acknowledges
// everything else, even later records of the failed one's key in the same
// call (as a publisher that splits a key over several requests may). It
// records each call's values and the order of acknowledgements.
type failOncePublisher struct {
	fail   string
	mu     sync.Mutex
	failed bool
	calls  [][]string
	acked  []string
}

func (p *failOncePublisher) Publish(_ context.Context, records []relay.Record) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	errs := make([]error, len(records))
	var call []string
	for i, r := range records {
		v := string(r.Value)
		call = append(call, v)
		if v == p.fail && !p.failed {
			p.failed = true
			errs[i] = errors.New("not enough replicas")
			continue
		}
		p.acked = append(p.acked, v)
	}
	p.calls = append(p.calls, call)
	return errs
}

func (p *failOncePublisher) Close() error { return nil }

// A failed record fails every later record of its key in that attempt,
// whatever the publisher reports for them: the relay does not take a later
// event of the key as published, and publishes it again after the failed
// one (G3).
func TestFailedRecordFailsItsKeysLaterRecords(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.write(t,
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("1")},
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("2")},
	)
	pub := &failOncePublisher{fail: "1"}
	b.drainWithPublisher(t, pub)
	pub.mu.Lock()
	defer pub.mu.Unlock()
	first1 := slices.Index(pub.acked, "1")
	last2 := -1
	for i, v := range pub.acked {
		if v == "2" {
			last2 = i
		}
	}
	if first1 < 0 || last2 < first1 {
		t.Fatalf("acknowledged %v: event 2 was taken as published although event 1 failed before it", pub.acked)
	}
}

// A key's later events wait for its failed event whatever their topics: an
// event of the key on another topic is not published in the same attempt
// as an earlier event that may fail, nor before it.
func TestKeysLaterEventOnAnotherTopicWaits(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.write(t,
		outbox.Message{Topic: "a", Key: []byte("K"), Value: []byte("a1")},
		outbox.Message{Topic: "b", Key: []byte("K"), Value: []byte("b2")},
		outbox.Message{Topic: "b", Key: []byte("L"), Value: []byte("l1")},
	)
	pub := &failOncePublisher{fail: "a1"}
	b.drainWithPublisher(t, pub)
	pub.mu.Lock()
	defer pub.mu.Unlock()
	a1, b2 := slices.Index(pub.acked, "a1"), slices.Index(pub.acked, "b2")
	if a1 < 0 || b2 < a1 {
		t.Fatalf("acknowledged %v: b2 went out before a1", pub.acked)
	}
	for _, call := range pub.calls {
		if slices.Contains(call, "a1") && slices.Contains(call, "b2") {
			t.Fatalf("a1 and b2 of one key on two topics were published in one call %v (calls %v)", call, pub.calls)
		}
	}
}
