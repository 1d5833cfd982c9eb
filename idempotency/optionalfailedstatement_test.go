package idempotency_test

import (
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/onceflow/onceflow/idempotency"
)

// helper 98: with KeyOptional, a request without a key still runs in the
// middleware's transaction (Transactional mode). A handler that meets a
// failed statement there (a unique violation it answers 409, say) leaves the
// transaction aborted; the middleware then commits it, pgx reports the
// COMMIT that became a ROLLBACK, and the client gets a 500 instead of the
// handler's 409. The keyed path answers and stores the 409
// (TestAClientErrorAfterAFailedStatementIsAnsweredAndStored); the keyless
// one replaces a client error with a server error on every try.
func TestOptionalKeyClientErrorAfterAFailedStatementIsAnswered(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var runs atomic.Int64
	srv := newServer(t, b, idempotency.Config{KeyOptional: true}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if _, err := idempotency.Tx(r.Context()).Exec(r.Context(), `SELECT 1/0`); err == nil {
			t.Error("SELECT 1/0 succeeded")
		}
		http.Error(w, "order already exists", http.StatusConflict)
	})
	r := send(t, srv, request{body: "{}"}) // no key
	if r.status != http.StatusConflict || r.body != "order already exists\n" {
		t.Fatalf("keyless request whose handler answered 409 after a failed statement: got %d %q, want the handler's 409",
			r.status, r.body)
	}
	if runs.Load() != 1 {
		t.Fatalf("handler ran %d times", runs.Load())
	}
}
