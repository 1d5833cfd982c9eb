package idempotency_test

// Defects a cold review (helper 62) found in the retried store
// (completeRetrying); each test failed on the code before its fix.

import (
	"context"
	"errors"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/idempotency"
)

// Fence.Do promises: "If storing the result fails after fn succeeded, Do
// tries again, backing off, for up to Lease (a database blip must not let a
// later call run fn again)". But the lease renewal is stopped before the
// retried store begins, so the lease lapses during the retries, at whatever
// was left of it (between 2/3 of a lease and a whole one), and a caller
// retrying meanwhile takes the key over and runs fn again, though the
// blip (2.7 s here) is shorter than the Lease (3 s). Storing later is
// refused (ErrLeaseLost), so the retries past the lapse buy nothing.
func TestDoBlipShorterThanTheLeaseLetsNoOtherCallRunFnAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const lease = 3 * time.Second
	blip := storeBlip(t, b, 2700*time.Millisecond)
	f := newFence(t, b, idempotency.FenceConfig{Lease: lease})
	var runs atomic.Int64
	fnDone := make(chan struct{})
	fn := func(context.Context) ([]byte, error) {
		if runs.Add(1) == 1 {
			// The claim's lease runs until ~3 s; the first renewal
			// would come at 1 s. fn ends at 0.8 s: 2.2 s of lease
			// left, less than the 2.7 s blip, itself shorter than the
			// Lease.
			time.Sleep(800 * time.Millisecond)
			blip()
			close(fnDone)
		}
		return []byte("receipt"), nil
	}
	first := make(chan error, 1)
	go func() {
		_, err := f.Do(context.Background(), "charge", fn)
		first <- err
	}()
	<-fnDone
	// A caller retrying (the same key) while the first stores its result.
	deadline := time.Now().Add(6 * time.Second)
	for time.Now().Before(deadline) {
		_, err := f.Do(context.Background(), "charge", fn)
		if err == nil || !errors.Is(err, idempotency.ErrInProgress) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	ferr := <-first
	if n := runs.Load(); n != 1 {
		t.Fatalf("a store blip of 2.7s (Lease 3s) let a later call run fn again: fn ran %d times; the first Do returned %v", n, ferr)
	}
}

// The same in Leased mode: the client's retry runs the handler (the
// charge) a second time during a blip shorter than the lease, and the
// first response is then never stored.
func TestLeasedBlipShorterThanTheLeaseLetsNoRetryRunTheHandlerAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const lease = 3 * time.Second
	blip := storeBlip(t, b, 2700*time.Millisecond)
	var runs atomic.Int64
	handlerDone := make(chan struct{})
	srv := newServer(t, b, idempotency.Config{Mode: idempotency.Leased, Lease: lease},
		func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) == 1 { // the charge
				time.Sleep(800 * time.Millisecond)
				blip()
				close(handlerDone)
			}
			w.WriteHeader(http.StatusCreated)
		})
	first := make(chan response, 1)
	go func() { first <- send(t, srv, request{key: "k", body: "{}"}) }()
	<-handlerDone
	deadline := time.Now().Add(6 * time.Second)
	for time.Now().Before(deadline) {
		if r := send(t, srv, request{key: "k", body: "{}"}); r.status != http.StatusConflict {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	<-first
	if n := runs.Load(); n != 1 {
		t.Fatalf("a store blip of 2.7s (Lease 3s) let the client's retry run the handler again: it ran %d times", n)
	}
}
