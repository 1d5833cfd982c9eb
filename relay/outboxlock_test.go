package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// An operator's long lock on the outbox (VACUUM FULL, CLUSTER, a migration
// rewriting it) stops the rounds, not the leases: the relays keep their
// shards, so that once it ends no relay takes another's for dead and
// publishes its events again, nor charges them a crash.
func TestALongLockOnTheOutboxLeavesTheLeasesAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	// Leases of 3 s, renewed every second: a lapse needs 2 s of missed
	// upkeep, not a loaded machine's scheduling delay.
	cfg := relay.Config{LeaseDuration: 3 * time.Second, PollInterval: 20 * time.Millisecond}
	for _, id := range []string{"a", "b"} {
		c := cfg
		c.InstanceID = id
		b.startRelay(t, c)
	}
	shards := pgx.Identifier{b.schema, "relay_shards"}.Sanitize()
	live := func() (a, bb, lapsed int) {
		if err := b.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE owner = 'a' AND lease_until > now()), count(*) FILTER (WHERE owner = 'b' AND lease_until > now()),
    count(*) FILTER (WHERE owner IS NULL OR lease_until <= now()) FROM `+shards).Scan(&a, &bb, &lapsed); err != nil {
			t.Fatal(err)
		}
		return a, bb, lapsed
	}
	waitFor(t, "both relays to hold shards", 30*time.Second, func() bool { a, bb, lapsed := live(); return a > 0 && bb > 0 && lapsed == 0 })

	tx, err := b.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `LOCK TABLE `+pgx.Identifier{b.schema, "outbox"}.Sanitize()+` IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(7 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if a, bb, lapsed := live(); lapsed > 0 {
			t.Fatalf("while the outbox was locked %d shards lapsed (a %d, b %d)", lapsed, a, bb)
		}
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	b.write(t, outbox.Message{Topic: b.kafka.Topic(t, 1), Key: []byte("k"), Value: []byte("after")})
	waitFor(t, "the outbox to drain after the lock", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
}

// A row of a dead relay's crashed round that another session holds locked
// (an operator's open transaction, or the dead host's backend that has not
// noticed its client is gone) must not stop the relays taking shards: the
// charge skips the row (it goes uncharged for that crash) and the rest of
// the upkeep goes on.
func TestALockedRowOfACrashedRoundDoesNotStopShardTakes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.write(t, outbox.Message{Topic: b.kafka.Topic(t, 1), Key: []byte("k"), Value: []byte("v")})
	outboxT := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	var id int64
	var shard int16
	if err := b.pool.QueryRow(ctx, `SELECT id, shard FROM `+outboxT).Scan(&id, &shard); err != nil {
		t.Fatal(err)
	}
	// A dead relay "d": its instance lapsed, every shard its, a round in flight.
	for _, s := range []string{
		`INSERT INTO ` + pgx.Identifier{b.schema, "relay_instances"}.Sanitize() + ` (id, lease_until) VALUES ('d', now() - interval '1 minute')`,
		`UPDATE ` + pgx.Identifier{b.schema, "relay_shards"}.Sanitize() + ` SET owner = 'd', lease_until = now() - interval '1 minute'`,
	} {
		if _, err := b.pool.Exec(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{b.schema, "relay_rounds"}.Sanitize()+` VALUES ('d', $1, $1, ARRAY[$2::smallint])`, id, shard); err != nil {
		t.Fatal(err)
	}
	tx, err := b.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT 1 FROM `+outboxT+` WHERE id = $1 FOR UPDATE`, id); err != nil {
		t.Fatal(err)
	}
	r, _ := b.startRelay(t, relay.Config{InstanceID: "a", LeaseDuration: time.Second, PollInterval: 20 * time.Millisecond})
	waitFor(t, "relay a to take the dead relay's shards", 15*time.Second, func() bool { return len(r.OwnedShards()) == relay.NumShards })
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the event to be published", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
}
