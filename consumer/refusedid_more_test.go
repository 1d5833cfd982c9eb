package consumer_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

// The message before a refused id is not lost. When order-0's COMMIT
// carried the BEGIN and dedup insert of an id the server cannot convert
// (22P05), the server refused the whole simple query before running any of
// it: the COMMIT never ran, the open transaction was aborted (status 'E'),
// and commit took that for "COMMIT went through, the next insert failed":
// order-0 was marked done, its handler's effect and dedup record rolled
// back. An id outside ASCII now begins by itself. (A reviewer's test.)
func TestRefusedIDDoesNotLoseTheMessageBefore(t *testing.T) {
	t.Parallel()
	pool := latin1Pool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (message_id text)`); err != nil {
		t.Fatal(err)
	}
	p, err := consumer.New(pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, m.ID)
		return err
	}, &consumer.Config{MaxAttempts: 3, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	w := start(t, p, tr, msg(0, "order-0", ""), msg(1, "订单-1", ""), msg(2, "order-2", ""))
	waitFor(t, 20*time.Second, "offset 2 marked done", func() bool { return tr.lastMark() == 2 })
	w.Stop(ctx)
	var effects, dedup []string
	rows, _ := pool.Query(ctx, `SELECT message_id FROM effects ORDER BY 1`)
	effects, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	rows, _ = pool.Query(ctx, `SELECT message_id FROM onceflow.processed_messages ORDER BY 1`)
	dedup, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(effects, " ") != "order-0 order-2" || strings.Join(dedup, " ") != "order-0 order-2" {
		t.Fatalf("marks %v; committed effects %q, dedup records %q; want order-0 and order-2 in both", tr.marks, effects, dedup)
	}
}

// Batch mode: the batch's insert is refused, the batch falls back to one
// message at a time, and only the refused message is dead-lettered.
func TestRefusedIDInBatchModeDeadLettersOnlyItsMessage(t *testing.T) {
	t.Parallel()
	pool := latin1Pool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (message_id text)`); err != nil {
		t.Fatal(err)
	}
	p, err := consumer.NewBatch(pool, "ledger", func(ctx context.Context, tx pgx.Tx, ms []consumer.Message) error {
		for _, m := range ms {
			if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, m.ID); err != nil {
				return err
			}
		}
		return nil
	}, &consumer.Config{MaxAttempts: 3, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	w := start(t, p, tr, msg(0, "order-0", ""), msg(1, "订单-1", ""), msg(2, "order-2", ""))
	waitFor(t, 20*time.Second, "offset 2 marked done", func() bool { return tr.lastMark() == 2 })
	w.Stop(ctx)
	dead := tr.deadLetters()
	if len(dead) != 1 || dead[0].Message.Offset != 1 || !strings.Contains(dead[0].Err.Error(), "22P05") {
		t.Fatalf("dead letters %+v", dead)
	}
	rows, _ := pool.Query(ctx, `SELECT message_id FROM effects ORDER BY 1`)
	effects, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(effects, " ") != "order-0 order-2" {
		t.Fatalf("effects %q", effects)
	}
	if s := pool.Stat(); s.AcquiredConns() != 0 {
		t.Fatalf("%d connections still acquired", s.AcquiredConns())
	}
}

// A refusal that is not the message's own (here the consumer's name, which
// the database cannot hold either) fails every message alike: it is waited
// out as the database's trouble, loudly, and dead-letters nothing.
func TestRefusedConsumerNameDeadLettersNothing(t *testing.T) {
	t.Parallel()
	pool := latin1Pool(t)
	hooks := &counter{}
	p, err := consumer.New(pool, "账本", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error { return nil },
		&consumer.Config{MaxAttempts: 2, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond, Hooks: []consumer.Hook{hooks}})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	w := start(t, p, tr, msg(0, "order-0", ""), msg(1, "订单-1", ""))
	waitFor(t, 20*time.Second, "retries", func() bool {
		hooks.mu.Lock()
		defer hooks.mu.Unlock()
		return hooks.retries >= 5
	})
	w.Stop(context.Background())
	if dead := tr.deadLetters(); len(dead) != 0 || tr.lastMark() != -1 {
		t.Fatalf("dead letters %+v, last mark %d: want none of either while the name is refused", dead, tr.lastMark())
	}
}
