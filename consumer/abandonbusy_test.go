package consumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/consumer"
)

// A handler abandoned by Stop while its statement runs on the server (it
// waits for a lock, with a context of its own, so pgx never cancels it): a
// closed socket is not noticed by a backend until it next talks to the
// client, so closing the connection alone leaves the transaction, and the
// message's uncommitted dedup record, in place until the statement ends.
// Stop must also cancel the statement, so the server rolls the transaction
// back at once and the redelivery does not wait for the lock.
// (Behind PgBouncer: internal/pgbouncertest.)
func TestStopEndsTheStatementOfAnAbandonedHandler(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	pool := ownPool(t, func(*pgxpool.Config) {})
	cfg := &consumer.Config{Schema: b.schema}
	// The lock the handler waits for, held by the test.
	locker, err := b.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Release()
	const lockID = 735021
	if _, err := locker.Exec(ctx, `SELECT pg_advisory_lock($1)`, lockID); err != nil {
		t.Fatal(err)
	}
	defer locker.Exec(ctx, `SELECT pg_advisory_unlock($1)`, lockID)

	pid, returned := make(chan uint32, 1), make(chan error, 1)
	p, err := consumer.New(pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if m.Offset == 1 {
			var backend uint32
			if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
				return err
			}
			pid <- backend
			_, err := tx.Exec(context.Background(), `SELECT pg_advisory_xact_lock($1)`, lockID)
			returned <- err
			return err
		}
		return b.record(ctx, tx, "ledger", m)
	}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	w := start(t, p, tr, msg(0, "m0", ""))
	waitFor(t, 10*time.Second, "offset 0 marked done", func() bool { return tr.lastMark() == 0 })
	if err := w.Add(ctx, msg(1, "m1", "")); err != nil {
		t.Fatal(err)
	}
	backend := <-pid
	waitFor(t, 10*time.Second, "the handler waiting for the lock", func() bool {
		var waiting bool
		_ = b.pool.QueryRow(ctx, `SELECT coalesce(bool_or(wait_event_type = 'Lock'), false) FROM pg_stat_activity WHERE pid = $1`, backend).Scan(&waiting)
		return waiting
	})
	stopCtx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	w.Stop(stopCtx) // returns half a second after the cancel, the handler abandoned

	// The lock is held for a minute more: the backend must not wait it out.
	deadline := time.Now().Add(5 * time.Second)
	for {
		var n int
		if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, backend).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			var state, wait string
			_ = b.pool.QueryRow(ctx, `SELECT coalesce(state, ''), coalesce(wait_event_type, '') FROM pg_stat_activity WHERE pid = $1`, backend).Scan(&state, &wait)
			t.Fatalf("5s after Stop the abandoned handler's backend is still there (state %q, waiting on %q): its transaction and m1's dedup record stay until its statement ends", state, wait)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := <-returned; err == nil {
		t.Error("the abandoned handler's statement succeeded")
	}

	// Delivered again: processed at once, exactly once.
	tr2, part2 := redeliver(t, b, msg(1, "m1", ""))
	defer part2.Stop(ctx)
	waitFor(t, 10*time.Second, "the redelivery marked done", func() bool { return tr2.lastMark() == 1 })
	waitFor(t, 10*time.Second, "the abandoned handler's connection back", func() bool { return pool.Stat().AcquiredConns() == 0 })
	checkAbandonedOnce(t, b, tr, 2)
}
