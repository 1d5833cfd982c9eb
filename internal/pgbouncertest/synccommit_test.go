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

// Behind PgBouncer in transaction mode (supported, README "Behind
// PgBouncer", with Config.PlainBegin) one client connection's transactions
// run on whichever server session is free. The Processor reads
// synchronous_commit once per client connection and caches it, so a
// server session with it off (a database or role default changed with
// ALTER DATABASE/ROLE and picked up by server connections PgBouncer opened
// since; or a session-level SET another client left on a server
// connection, as here) is never raised: the message's COMMIT is
// asynchronous, the offset is committed after it, and a PostgreSQL crash
// loses the effect and its dedup record for good (G5). (Cold review,
// helper 64: failed on 227edad, which read the setting once per client
// connection; each transaction checks its own server session now.)
func TestSynchronousCommitIsRaisedOnEachServerSessionBehindPgBouncer(t *testing.T) {
	schema := pgtest.Schema(t)
	ctx := context.Background()
	url := pgbouncertest.StartPrivate(t).TransactionURL + "&default_query_exec_mode=exec"
	pool := poolFor(t, url)

	var mu sync.Mutex
	seen := map[string]string{}
	p, err := consumer.New(pool, "h64", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		var s string
		if err := tx.QueryRow(ctx, `SELECT current_setting('synchronous_commit')`).Scan(&s); err != nil {
			return err
		}
		mu.Lock()
		seen[m.ID] = s
		mu.Unlock()
		return nil
	}, &consumer.Config{Schema: schema, PlainBegin: true})
	if err != nil {
		t.Fatal(err)
	}
	tr := &marks{last: -1}
	w := p.StartPartition(ctx, tr)
	defer w.Stop(ctx)
	msg := func(off int64, id string) consumer.Message {
		return consumer.Message{Topic: "orders", Offset: off, Headers: []consumer.Header{{Key: "message-id", Value: []byte(id)}}}
	}
	// Every client connection of the pool reads the setting (on) once.
	for i := range 8 {
		if err := w.Add(ctx, msg(int64(i), "warm"+string(rune('a'+i)))); err != nil {
			t.Fatal(err)
		}
	}
	waitUntil(t, "the first messages marked done", 10*time.Second, func() bool { return tr.get() == 7 })

	// Another client leaves synchronous_commit off on every server
	// connection of the pool (each held at once, so each is a different one).
	const n = 12
	txs := make([]pgx.Tx, 0, n)
	for range n {
		c, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(ctx)
		tx, err := c.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `SET synchronous_commit = off`); err != nil {
			t.Fatal(err)
		}
		txs = append(txs, tx)
	}
	for _, tx := range txs {
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}

	if err := w.Add(ctx, msg(8, "after")); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the message marked done", 10*time.Second, func() bool { return tr.get() == 8 })
	mu.Lock()
	defer mu.Unlock()
	if got := seen["after"]; got != "on" {
		t.Fatalf("the Processor's transaction ran with synchronous_commit %q on a server session that has it off: its COMMIT was not durable, and the offset was committed after it (before the warm-up messages saw %q)", got, seen["warma"])
	}
}
