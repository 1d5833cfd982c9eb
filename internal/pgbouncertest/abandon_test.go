package pgbouncertest_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgbouncertest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// marks is a consumer.Transport that records the last offset marked done.
type marks struct {
	mu   sync.Mutex
	last int64
}

func (m *marks) MarkDone(msg consumer.Message) {
	m.mu.Lock()
	m.last = msg.Offset
	m.mu.Unlock()
}

func (m *marks) PublishDeadLetter(context.Context, consumer.DeadLetter) error { return nil }

func (m *marks) get() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.last
}

// A handler abandoned by Partition.Stop while its statement runs on the
// server (a lock wait, with a context of its own, so pgx never cancels it),
// behind PgBouncer in transaction mode: the backend would notice the
// closed client only once the statement ends, and the cancel pgx sends
// after the socket closed no longer finds the client in PgBouncer. Stop
// must end the statement, so the server rolls the transaction and the
// message's dedup record back at once and the redelivery goes ahead.
func TestStopEndsTheStatementOfAnAbandonedHandlerBehindPgBouncer(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	ctx := context.Background()
	direct := pgtest.Pool(t)
	pool := poolFor(t, pgbouncertest.Start(t).TransactionURL+"&default_query_exec_mode=exec")
	locker, err := direct.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Release()
	const lockID = 735022
	if _, err := locker.Exec(ctx, `SELECT pg_advisory_lock($1)`, lockID); err != nil {
		t.Fatal(err)
	}
	defer locker.Exec(ctx, `SELECT pg_advisory_unlock($1)`, lockID)

	pid := make(chan uint32, 1)
	p, err := consumer.New(pool, "pgb", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		var backend uint32
		if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
			return err
		}
		pid <- backend
		_, err := tx.Exec(context.Background(), `SELECT pg_advisory_xact_lock($1)`, lockID)
		return err
	}, &consumer.Config{Schema: schema, PlainBegin: true})
	if err != nil {
		t.Fatal(err)
	}
	m := consumer.Message{Topic: "orders", Offset: 0, Headers: []consumer.Header{{Key: "message-id", Value: []byte("m0")}}}
	tr := &marks{last: -1}
	w := p.StartPartition(ctx, tr)
	if err := w.Add(ctx, m); err != nil {
		t.Fatal(err)
	}
	backend := <-pid
	waitUntil(t, "the handler waiting for the lock", 10*time.Second, func() bool {
		var waiting bool
		_ = direct.QueryRow(ctx, `SELECT coalesce(bool_or(wait_event_type = 'Lock'), false) FROM pg_stat_activity WHERE pid = $1`, backend).Scan(&waiting)
		return waiting
	})
	stopCtx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	w.Stop(stopCtx) // returns half a second after the cancel, the handler abandoned

	// The lock stays held: the backend must not wait it out.
	if !waitFor(5*time.Second, func() bool {
		var n int
		_ = direct.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active'`, backend).Scan(&n)
		return n == 0
	}) {
		t.Fatal("5s after Stop the abandoned handler's statement still runs: its transaction and m0's dedup record stay until the statement ends")
	}

	// Delivered again (directly): processed at once, exactly once.
	p2, err := consumer.New(direct, "pgb", func(context.Context, pgx.Tx, consumer.Message) error { return nil }, &consumer.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	tr2 := &marks{last: -1}
	w2 := p2.StartPartition(ctx, tr2)
	defer w2.Stop(ctx)
	if err := w2.Add(ctx, m); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the redelivery marked done", 10*time.Second, func() bool { return tr2.get() == 0 })
	var n int
	if err := direct.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "processed_messages"}.Sanitize()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 || tr.get() != -1 {
		t.Fatalf("dedup records = %d (want 1), abandoned partition's last mark = %d (want none)", n, tr.get())
	}
}
