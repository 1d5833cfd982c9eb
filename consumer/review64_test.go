package consumer_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// A handler lowers synchronous_commit for its own transaction but writes
// SET instead of SET LOCAL (the usual "speed up a bulk write" advice):
// inside a transaction the setting outlives the COMMIT. The Processor read
// the session's setting (on) before and caches it for the connection's
// life, so every later message on that connection commits asynchronously
// and its offset is committed after a COMMIT a crash can undo (G5).
// (Cold review, helper 64: failed on 227edad, which read the setting once
// per connection.)
func TestAHandlersSessionSetOffIsRaisedForLaterMessages(t *testing.T) {
	schema := pgtest.Schema(t)
	ctx := context.Background()
	pool := pgtest.TracedPool(t, nil, 1) // one connection: every message on it
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
		if m.ID == "bulk" {
			_, err := tx.Exec(ctx, `SET synchronous_commit = off`)
			return err
		}
		return nil
	}, &consumer.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	w := p.StartPartition(ctx, tr)
	defer w.Stop(ctx)
	for i, id := range []string{"first", "bulk"} {
		if err := w.Add(ctx, consumer.Message{Topic: "t", Offset: int64(i), Headers: []consumer.Header{{Key: "message-id", Value: []byte(id)}}}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 10*time.Second, "two messages marked", func() bool { return tr.lastMark() == 1 })
	if err := w.Add(ctx, consumer.Message{Topic: "t", Offset: 2, Headers: []consumer.Header{{Key: "message-id", Value: []byte("later")}}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the later message marked", func() bool { return tr.lastMark() == 2 })
	mu.Lock()
	defer mu.Unlock()
	if seen["later"] != "on" {
		t.Fatalf("a later message's transaction ran with synchronous_commit %q (the session was left off by an earlier handler): not raised", seen["later"])
	}
}
