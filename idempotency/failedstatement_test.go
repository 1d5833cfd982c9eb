package idempotency_test

import (
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/onceflow/onceflow/idempotency"
)

// A handler that meets a failed statement in the middleware's transaction
// (a unique violation it answers as 409, say) leaves that transaction
// aborted. Its answer is a client error, which the middleware stores like any
// other: the client must get the handler's 409, and a retry its replay, not a
// 500 from storing the response in the aborted transaction on every try.
func TestAClientErrorAfterAFailedStatementIsAnsweredAndStored(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var runs atomic.Int64
	srv := newServer(t, b, idempotency.Config{}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if err := writeEffect(r.Context(), b.pool, b.schema, "before the failure"); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if _, err := idempotency.Tx(r.Context()).Exec(r.Context(), `SELECT 1/0`); err == nil {
			t.Error("SELECT 1/0 succeeded")
		}
		http.Error(w, "order already exists", http.StatusConflict)
	})
	for try := range 3 {
		r := send(t, srv, request{key: "k", body: "{}"})
		if r.status != http.StatusConflict || r.replayed != (try > 0) || r.body != "order already exists\n" {
			t.Errorf("try %d: %d replayed=%v %q, want 409 replayed=%v", try, r.status, r.replayed, r.body, try > 0)
		}
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
	// The aborted transaction's writes are gone; only the answer is kept.
	if n := b.effects(t); n != 0 {
		t.Errorf("%d effects written, want 0", n)
	}
	if n := b.records(t); n != 1 {
		t.Errorf("%d idempotency records, want 1", n)
	}
}

// A success answered after a failed statement describes writes that were
// never made: it must not reach the client as a success nor be stored, and a
// retry runs the handler again.
func TestASuccessAfterAFailedStatementIsAnErrorAndNotStored(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var runs atomic.Int64
	srv := newServer(t, b, idempotency.Config{}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if err := writeEffect(r.Context(), b.pool, b.schema, "lost"); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		_, _ = idempotency.Tx(r.Context()).Exec(r.Context(), `SELECT 1/0`) // the handler ignores it
		w.WriteHeader(http.StatusCreated)
	})
	for try := range 2 {
		if r := send(t, srv, request{key: "k", body: "{}"}); r.status != http.StatusInternalServerError || r.replayed {
			t.Errorf("try %d: %d replayed=%v, want 500", try, r.status, r.replayed)
		}
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("handler ran %d times, want 2 (nothing stored)", n)
	}
	if n, m := b.effects(t), b.records(t); n != 0 || m != 0 {
		t.Errorf("%d effects and %d records, want none", n, m)
	}
}
