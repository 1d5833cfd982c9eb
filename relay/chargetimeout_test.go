package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
)

// A role's statement_timeout (managed PostgreSQL often sets one) shorter
// than the charge of a crashed round stopped every relay for good: the
// charge runs before any shard is taken, and each tick retried the same
// work, cancelled again (helper 70: 300,000 of 300,000 events pending
// after 40 s, at 20 ms and a dead relay's round of 1,000 ids). The charge
// is bounded by the rounds it charges, so it runs without the session's
// statement_timeout (lock_timeout still bounds its waits). Here the
// sessions have a 50 ms statement_timeout, and two crashed rounds of
// 60,000 ids each (BatchSize goes to 100,000), a dead relay's and the
// restarted relay's own, take longer than that to charge.
func TestAShortStatementTimeoutDoesNotStopTheCrashCharges(t *testing.T) {
	if testing.Short() {
		t.Skip("inserts 120,000 rows; skipped with -short")
	}
	b := setup(t)
	ctx := context.Background()
	outboxTable := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	topic := b.kafka.Topic(t, 4)
	const events, round = 120_000, 60_000
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+outboxTable+` (topic, key, value)
SELECT $1, ('key-' || (g % 1000))::bytea, convert_to(repeat('x', 64), 'UTF8') FROM generate_series(1, $2) g`, topic, events); err != nil {
		t.Fatal(err)
	}
	if _, err := b.pool.Exec(ctx, `VACUUM ANALYZE `+outboxTable); err != nil {
		t.Fatal(err)
	}
	const restarted = "timeout-test-relay"
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{b.schema, "relay_instances"}.Sanitize()+
		` (id, lease_until) VALUES ('dead-relay', now() - interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{b.schema, "relay_rounds"}.Sanitize()+` (instance, lo, hi, shards)
SELECT x.instance, min(o.id) + x.skip, min(o.id) + x.skip + $2 - 1, (SELECT array_agg(g::smallint) FROM generate_series(0, 255) g)
FROM `+outboxTable+` o, (VALUES ('dead-relay', 0), ($1, $2)) AS x(instance, skip)
GROUP BY x.instance, x.skip`, restarted, round); err != nil {
		t.Fatal(err)
	}

	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["statement_timeout"] = "50ms"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	b.startRelayWith(t, pool, b.publisher(t), relay.Config{InstanceID: restarted, LeaseDuration: 3 * time.Second})
	waitFor(t, "every event to be published", 2*time.Minute, func() bool { return b.count(t, "outbox") == 0 })
	if n := b.count(t, "relay_rounds"); n != 0 {
		t.Fatalf("%d rounds left in relay_rounds", n)
	}
	published := map[string]bool{}
	for _, r := range b.kafka.ReadAll(t, topic, events, time.Minute) {
		for _, h := range r.Headers {
			if h.Key == "message-id" {
				published[string(h.Value)] = true
			}
		}
	}
	if len(published) != events {
		t.Fatalf("read %d distinct events back, want %d", len(published), events)
	}
}
