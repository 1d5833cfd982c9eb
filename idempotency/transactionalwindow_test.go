package idempotency_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/idempotency"
)

// helper 98: Config.Window says a record lives "at least that long after
// its response is stored". In Transactional mode the claim and the store
// run in the handler's transaction, where now() is the transaction's start
// (BEGIN): expires_at = greatest(claim's now()+Window, store's now()+Window)
// is BEGIN+Window however long the handler ran, and completed_at is BEGIN.
// A handler slower than Window commits a record already expired, and the
// client's retry right after the answer runs the handler again: a second
// business row under one key.
func TestTransactionalRecordLivesItsWindowAfterTheCommit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var runs atomic.Int64
	srv := newServer(t, b, idempotency.Config{Window: time.Second}, func(w http.ResponseWriter, r *http.Request) {
		if runs.Add(1) == 1 {
			time.Sleep(1500 * time.Millisecond) // a slow first run
		}
		if err := writeEffect(r.Context(), b.pool, b.schema, "order"); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	first := send(t, srv, request{key: "k-slow", body: "{}"})
	if first.status != http.StatusCreated {
		t.Fatalf("first: %d %q", first.status, first.body)
	}
	var created, completed, expires time.Time
	var expired bool
	table := pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()
	if err := b.pool.QueryRow(context.Background(), `SELECT created_at, completed_at, expires_at, expires_at <= now() FROM `+table+
		` WHERE key = 'k-slow'`).Scan(&created, &completed, &expires, &expired); err != nil {
		t.Fatal(err)
	}
	retry := send(t, srv, request{key: "k-slow", body: "{}"}) // at once, well within the 1s window
	if !retry.replayed || runs.Load() != 1 || b.effects(t) != 1 {
		t.Fatalf("retry right after a 1.5s first run (Window 1s): %d replayed=%v; handler ran %d times, %d business rows; want a replay, 1 run, 1 row "+
			"(record as committed: created %s, completed %s (+%s), expires %s, already expired: %v)",
			retry.status, retry.replayed, runs.Load(), b.effects(t), created.Format(time.StampMilli), completed.Format(time.StampMilli),
			completed.Sub(created), expires.Format(time.StampMilli), expired)
	}
}
