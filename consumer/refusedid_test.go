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

// A message whose id the database refuses for the message's own sake (here
// a character a LATIN1 database cannot store: SQLSTATE 22P05, a data
// exception) is not the database being down: it goes to the dead-letter
// topic with the error, and the partition moves on (G6). It was retried
// as "database unavailable" forever, without spending the retry budget,
// and the message after it never ran. In both ways a message begins.
func TestDedupInsertRefusedForTheMessageGoesToTheDeadLetterTopic(t *testing.T) {
	for _, plain := range []bool{false, true} {
		t.Run(map[bool]string{false: "begin and insert in one round trip", true: "PlainBegin"}[plain], func(t *testing.T) {
			t.Parallel()
			pool := latin1Pool(t)
			ran := make(chan string, 4)
			handler := func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
				ran <- m.ID
				return nil
			}
			p, err := consumer.New(pool, "ledger", handler, &consumer.Config{
				PlainBegin: plain, MaxAttempts: 3, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
			})
			if err != nil {
				t.Fatal(err)
			}
			tr := &memTransport{}
			// The refused message in the middle: with a pooled connection,
			// the COMMIT before it carries its BEGIN and dedup insert.
			w := start(t, p, tr, msg(0, "order-0", ""), msg(1, "订单-1", ""), msg(2, "order-2", ""))
			defer w.Stop(context.Background())
			waitFor(t, 20*time.Second, "the message after the refused one marked done", func() bool { return tr.lastMark() == 2 })
			dead := tr.deadLetters()
			if len(dead) != 1 || dead[0].Message.Offset != 1 || !strings.Contains(dead[0].Err.Error(), "22P05") {
				t.Fatalf("dead letters %+v, want offset 1 with the database's refusal (22P05)", dead)
			}
			close(ran)
			var got []string
			for id := range ran {
				got = append(got, id)
			}
			if strings.Join(got, " ") != "order-0 order-2" {
				t.Fatalf("the handler ran for %q, want order-0 and order-2", got)
			}
		})
	}
}
