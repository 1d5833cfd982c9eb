package idempotency_test

import (
	"errors"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/onceflow/onceflow/idempotency"
)

// helper 112: Tx(ctx) was the request's transaction itself, so a handler
// (or a repository helper it calls) that committed it committed the
// business rows without the claim's record: the middleware's store then
// failed on the closed transaction and answered 500, and the client's
// retry ran the handler again, writing the rows twice. Commit and
// Rollback through Tx(ctx) now refuse (ErrTxOwned) and leave the
// transaction to the middleware.
func TestAHandlerCannotCommitTheRequestsTransaction(t *testing.T) {
	t.Parallel()
	for _, end := range []string{"commit", "rollback"} {
		t.Run(end, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			var refused atomic.Int64
			srv := newServer(t, b, idempotency.Config{}, func(w http.ResponseWriter, r *http.Request) {
				if err := writeEffect(r.Context(), b.pool, b.schema, "paid"); err != nil {
					t.Error(err)
				}
				tx := idempotency.Tx(r.Context())
				var err error
				if end == "commit" {
					err = tx.Commit(r.Context())
				} else {
					err = tx.Rollback(r.Context())
				}
				if errors.Is(err, idempotency.ErrTxOwned) {
					refused.Add(1)
				}
				w.WriteHeader(http.StatusCreated)
			})
			for i := range 2 {
				if r := send(t, srv, request{key: "k", body: "{}"}); r.status != http.StatusCreated || r.replayed != (i == 1) {
					t.Fatalf("try %d: %d replayed=%v, want 201 replayed=%v", i, r.status, r.replayed, i == 1)
				}
			}
			if refused.Load() != 1 || b.effects(t) != 1 || b.records(t) != 1 {
				t.Fatalf("the handler's %s refused %d times (want 1); effects %d, records %d (want 1 and 1: committed once, with the response)",
					end, refused.Load(), b.effects(t), b.records(t))
			}
		})
	}
}
