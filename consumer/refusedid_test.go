package consumer_test

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// latin1Pool returns a pool, with client_encoding UTF8, on a database of
// its own whose server encoding is LATIN1 (dropped when the test ends),
// with onceflow's migrations applied in schema "onceflow".
func latin1Pool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	name := pgtest.NewSchemaName()
	admin := pgtest.Pool(t)
	if _, err := admin.Exec(ctx, `CREATE DATABASE `+pgx.Identifier{name}.Sanitize()+
		` ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0`); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	q := u.Query()
	q.Set("client_encoding", "UTF8") // the server converts, and refuses what LATIN1 cannot hold
	u.RawQuery = q.Encode()
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pool.Close()
		_, _ = admin.Exec(context.Background(), `DROP DATABASE IF EXISTS `+pgx.Identifier{name}.Sanitize()+` WITH (FORCE)`)
	})
	if _, err := migrations.Up(ctx, pool, migrations.DefaultSchema); err != nil {
		t.Fatal(err)
	}
	return pool
}

// A message whose id the database cannot hold (a character a LATIN1
// database has no equivalent for: SQLSTATE 22P05) is not the database
// being down: it goes to the dead-letter topic with the error, and the
// partition moves on (G6). It was retried as "database unavailable"
// forever, without spending the retry budget, and the message after it
// never ran. Nor is the message before it lost: when that message's COMMIT
// carried the refused id's BEGIN and dedup insert, the server refused the
// whole simple query before running the COMMIT, the open transaction was
// aborted, and commit took that for "COMMIT went through, the next insert
// failed": the message was marked done, its effect and dedup record rolled
// back (a reviewer's test found it). An id outside ASCII now begins by
// itself. In each way a message begins, and in batch mode (the batch's
// insert refused, its messages run one at a time).
func TestDedupInsertRefusedForTheMessageGoesToTheDeadLetterTopic(t *testing.T) {
	for _, mode := range []string{"begin and insert in one round trip", "PlainBegin", "batch"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			pool := latin1Pool(t)
			ctx := context.Background()
			if _, err := pool.Exec(ctx, `CREATE TABLE effects (message_id text)`); err != nil {
				t.Fatal(err)
			}
			ran := make(chan string, 4)
			record := func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
				ran <- m.ID
				_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, m.ID)
				return err
			}
			cfg := &consumer.Config{PlainBegin: mode == "PlainBegin", MaxAttempts: 3, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond}
			var p *consumer.Processor
			var err error
			if mode == "batch" {
				p, err = consumer.NewBatch(pool, "ledger", func(ctx context.Context, tx pgx.Tx, ms []consumer.Message) error {
					for _, m := range ms {
						if err := record(ctx, tx, m); err != nil {
							return err
						}
					}
					return nil
				}, cfg)
			} else {
				p, err = consumer.New(pool, "ledger", record, cfg)
			}
			if err != nil {
				t.Fatal(err)
			}
			tr := &memTransport{}
			// The refused message in the middle: with a pooled connection,
			// the COMMIT before it would carry its BEGIN and dedup insert.
			w := start(t, p, tr, msg(0, "order-0", ""), msg(1, "订单-1", ""), msg(2, "order-2", ""))
			waitFor(t, 20*time.Second, "the message after the refused one marked done", func() bool { return tr.lastMark() == 2 })
			w.Stop(ctx)
			dead := tr.deadLetters()
			if len(dead) != 1 || dead[0].Message.Offset != 1 || !strings.Contains(dead[0].Err.Error(), "22P05") {
				t.Fatalf("dead letters %+v, want offset 1 with the database's refusal (22P05)", dead)
			}
			close(ran)
			got := map[string]bool{}
			for id := range ran {
				got[id] = true
			}
			if len(got) != 2 || !got["order-0"] || !got["order-2"] {
				t.Fatalf("the handler ran for %v, want order-0 and order-2", got)
			}
			effects := column(t, pool, `SELECT message_id FROM effects ORDER BY 1`)
			dedup := column(t, pool, `SELECT message_id FROM onceflow.processed_messages ORDER BY 1`)
			if strings.Join(effects, " ") != "order-0 order-2" || strings.Join(dedup, " ") != "order-0 order-2" {
				t.Fatalf("marks %v; committed effects %q, dedup records %q; want order-0 and order-2 in both", tr.marks, effects, dedup)
			}
			if s := pool.Stat(); s.AcquiredConns() != 0 {
				t.Fatalf("%d connections still acquired", s.AcquiredConns())
			}
		})
	}
}

// column returns the one column of query's rows.
func column(t *testing.T, pool *pgxpool.Pool, query string) []string {
	t.Helper()
	rows, _ := pool.Query(context.Background(), query)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
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
