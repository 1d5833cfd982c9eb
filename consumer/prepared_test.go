package consumer_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/proctest"
)

// A pooler in transaction mode (PgBouncer before 1.21) lends each
// transaction whichever server connection is free, so the dedup insert
// prepared on one server connection is missing on the next (SQLSTATE
// 26000), or a client connection new to a server finds it there already
// (42P05). These tests make each happen on a plain connection, for certain,
// and check that the Processor begins every later message without the
// statement instead of retrying the same failure as an outage (a CI run's
// consumer behind PgBouncer made no progress for 90 s).

// dedupStatement returns the name of the dedup insert into schema's table
// prepared on tx's connection, or "" if there is none.
func dedupStatement(ctx context.Context, tx pgx.Tx, schema string) (string, error) {
	var name string
	err := tx.QueryRow(ctx, `SELECT coalesce(max(name), '') FROM pg_prepared_statements
		WHERE name LIKE 'onceflow\_dedup\_%' AND strpos(statement, $1) > 0`, pgx.Identifier{schema}.Sanitize()).Scan(&name)
	return name, err
}

// poolOf returns a pool of one connection (so every message meets the
// server session the test tampered with), after run on each new connection.
func poolOf(t *testing.T, after func(context.Context, *pgx.Conn) error) *pgxpool.Pool {
	t.Helper()
	return ownPool(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 1
		cfg.AfterConnect = after
	})
}

// processAll runs msgs through one partition of p, all queued at once
// (each COMMIT then carries the next BEGIN) or one at a time, and waits
// until each is marked done.
func processAll(t *testing.T, p *consumer.Processor, queued bool, msgs []consumer.Message) {
	t.Helper()
	ctx := context.Background()
	tr := &memTransport{}
	w := p.StartPartition(ctx, tr)
	defer w.Stop(ctx)
	for i, m := range msgs {
		if !queued || i == 0 {
			if err := w.Add(ctx, m); err != nil {
				t.Fatal(err)
			}
		}
		if queued && i == 0 {
			if err := w.Add(ctx, msgs[1:]...); err != nil {
				t.Fatal(err)
			}
		}
		if !queued {
			waitFor(t, 30*time.Second, fmt.Sprintf("offset %d marked done", m.Offset), func() bool { return tr.lastMark() == m.Offset })
		}
	}
	last := msgs[len(msgs)-1].Offset
	waitFor(t, 30*time.Second, fmt.Sprintf("offset %d marked done", last), func() bool { return tr.lastMark() == last })
}

// checkFellBack checks every message's effect once, and a log that says
// the Processor fell back once, and never waited as for an outage.
func checkFellBack(t *testing.T, b *bundle, n int, logs string) {
	t.Helper()
	for i := range n {
		if got := b.count(t, "message_id = $1", fmt.Sprintf("id-%d", i)); got != 1 {
			t.Errorf("effects of id-%d = %d, want 1", i, got)
		}
	}
	if got := strings.Count(logs, "without its prepared statement"); got != 1 {
		t.Errorf("fallback logged %d times, want once; log:\n%s", got, logs)
	}
	if strings.Contains(logs, "database unavailable") {
		t.Errorf("a missing prepared statement was waited out as an outage; log:\n%s", logs)
	}
}

func TestDedupStatementMissingOnTheServerFallsBackToPlainBegin(t *testing.T) {
	for _, queued := range []bool{false, true} {
		t.Run(fmt.Sprintf("queued=%v", queued), func(t *testing.T) {
			b := setup(t)
			pool := poolOf(t, nil)
			var logs proctest.Buffer
			p, err := consumer.New(pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
				if m.ID == "id-0" {
					// The next transaction lands on a server session
					// without the statement (DEALLOCATE is not
					// transactional: it holds after this commits).
					name, err := dedupStatement(ctx, tx, b.schema)
					if err != nil || name == "" {
						return fmt.Errorf("dedup statement on the connection: %q, %v", name, err)
					}
					if _, err := tx.Exec(ctx, `DEALLOCATE `+pgx.Identifier{name}.Sanitize()); err != nil {
						return err
					}
				}
				return b.record(ctx, tx, "ledger", m)
			}, &consumer.Config{Schema: b.schema, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			if err != nil {
				t.Fatal(err)
			}
			var msgs []consumer.Message
			for i := range 6 {
				msgs = append(msgs, msg(int64(i), fmt.Sprintf("id-%d", i), "k"))
			}
			processAll(t, p, queued, msgs)
			checkFellBack(t, b, len(msgs), logs.String())
		})
	}
}

func TestDedupStatementAlreadyOnTheServerFallsBackToPlainBegin(t *testing.T) {
	b := setup(t)
	// The statement's name, as the Processor prepares it for this schema.
	var name string
	first, err := consumer.New(poolOf(t, nil), "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		var err error
		name, err = dedupStatement(ctx, tx, b.schema)
		return err
	}, &consumer.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	processAll(t, first, false, []consumer.Message{msg(0, "probe", "")})
	if name == "" {
		t.Fatal("no dedup statement prepared on the first Processor's connection")
	}
	// Another client prepared it on the server session before this one.
	pool := poolOf(t, func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, `PREPARE `+pgx.Identifier{name}.Sanitize()+` AS SELECT 1`, pgx.QueryExecModeSimpleProtocol)
		return err
	})
	var logs proctest.Buffer
	p, err := consumer.New(pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	var msgs []consumer.Message
	for i := range 4 {
		msgs = append(msgs, msg(int64(i), fmt.Sprintf("id-%d", i), "k"))
	}
	processAll(t, p, true, msgs)
	checkFellBack(t, b, len(msgs), logs.String())
}
