package idempotency_test

// Defects a cold review (helper 78) found; each test failed on the code
// before its fix, as its comment says.

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/idempotency"
)

// A Leased handler runs on the request's context, so a client that gives up
// cancels it. A handler that returns without writing when its context ends
// (common in Go: nobody is left to answer) must not be stored as a success:
// the work never happened. The key is released and the retry runs the
// handler. Before the fix the recorder's default 200 was stored, and the
// retry was answered a replayed 200 with an empty body, the handler having
// run once and never completed.
func TestLeasedHandlerWhoseClientLeftAndThatWroteNothingIsRunAgainOnRetry(t *testing.T) {
	clientGoneHandlerWroteNothing(t, idempotency.Leased)
}

// Transactional mode already got this right (the commit fails on the
// cancelled context); it is kept so.
func TestTransactionalHandlerWhoseClientLeftAndThatWroteNothingIsRunAgainOnRetry(t *testing.T) {
	clientGoneHandlerWroteNothing(t, idempotency.Transactional)
}

func clientGoneHandlerWroteNothing(t *testing.T, mode idempotency.Mode) {
	t.Parallel()
	b := setup(t)
	var runs, completed atomic.Int64
	srv := newServer(t, b, idempotency.Config{Mode: mode},
		func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			select {
			case <-time.After(time.Second): // the downstream call
				completed.Add(1)
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write([]byte(`{"charged":true}`))
			case <-r.Context().Done():
				return // the client is gone: nothing to answer
			}
		})
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader("{}"))
	req.Header.Set(idempotency.KeyHeader, "pay-1")
	req.Header.Set("X-User", "alice")
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
		t.Fatal("the first try did not time out")
	}
	var got response
	waitFor(t, 10*time.Second, "the retry not to be 409", func() bool {
		got = send(t, srv, request{key: "pay-1", body: "{}"})
		return got.status != http.StatusConflict
	})
	if got.replayed || got.status != http.StatusCreated || completed.Load() != 1 {
		t.Fatalf("retry: %d %q (replayed %v); the handler ran %d times and completed %d, want a fresh 201 from a second run",
			got.status, got.body, got.replayed, runs.Load(), completed.Load())
	}
}

// The same through a lost lease: renewals fail, the middleware cancels the
// handler's context with ErrLeaseLost, and the handler stops without
// writing. Nothing is stored (another holder may own the key), the client
// is answered 503 and the key is released, so the retry runs the handler.
// Before the fix the client was answered an empty 200 for work it had been
// told to abandon, and the 200 was stored and replayed to every retry.
func TestLeasedHandlerStoppedForALostLeaseThatWroteNothingIsAnswered503AndRunAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	started, locked := make(chan struct{}), make(chan struct{})
	var runs, completed atomic.Int64
	srv := newServer(t, b, idempotency.Config{Mode: idempotency.Leased, Lease: 3 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) > 1 {
				completed.Add(1)
				w.WriteHeader(http.StatusCreated)
				return
			}
			close(started)
			<-locked
			select {
			case <-time.After(10 * time.Second): // the downstream call
				completed.Add(1)
				w.WriteHeader(http.StatusCreated)
			case <-r.Context().Done():
				return // told to stop
			}
		})
	done := make(chan response, 1)
	go func() { done <- send(t, srv, request{key: "k", body: "{}"}) }()
	<-started
	unlock := lockClaim(t, b)
	close(locked)
	time.Sleep(3 * time.Second) // past Lease*5/6: the handler is cancelled
	unlock()
	first := <-done
	if first.status != http.StatusServiceUnavailable {
		t.Fatalf("first: %d %q, want 503: the handler was told to stop and answered nothing", first.status, first.body)
	}
	var retry response
	waitFor(t, 10*time.Second, "the retry not to be 409", func() bool {
		retry = send(t, srv, request{key: "k", body: "{}"})
		return retry.status != http.StatusConflict
	})
	if retry.replayed || retry.status != http.StatusCreated || completed.Load() != 1 {
		t.Fatalf("retry: %d (replayed %v); the handler ran %d times and completed %d, want a fresh 201",
			retry.status, retry.replayed, runs.Load(), completed.Load())
	}
}
