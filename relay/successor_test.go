package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/relay"
)

// A's lease lapsed (a database partition, simulated) and B took the
// instance id; A is stopped before its next lease tick notices. A's
// shutdown must not hand back B's shards or delete B's instance row.
func TestStoppedRelayKeepsSuccessorsShards(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	shards := pgx.Identifier{b.schema, "relay_shards"}.Sanitize()
	instances := pgx.Identifier{b.schema, "relay_instances"}.Sanitize()
	owned := func() (n int) {
		_ = b.pool.QueryRow(ctx, `SELECT count(*) FROM `+shards+` WHERE owner = 'same' AND lease_until > now()`).Scan(&n)
		return n
	}
	_, stopA := b.startRelay(t, relay.Config{InstanceID: "same", LeaseDuration: 30 * time.Second})
	waitFor(t, "A to own shards", 20*time.Second, func() bool { return owned() > 0 })
	for _, q := range []string{`UPDATE ` + instances + ` SET lease_until = now() - interval '1s' WHERE id = 'same'`,
		`UPDATE ` + shards + ` SET lease_until = now() - interval '1s' WHERE owner = 'same'`} {
		if _, err := b.pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	pub := b.publisher(t)
	defer pub.Close()
	rB, err := relay.New(b.pool, pub, &relay.Config{Schema: b.schema, InstanceID: "same", LeaseDuration: 30 * time.Second, PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go rB.Run(cctx)
	waitFor(t, "B to take the id and the shards", 5*time.Second, func() bool { return owned() == relay.NumShards })
	stopA() // within A's 10 s lease interval: A has not ticked since
	var rows int
	_ = b.pool.QueryRow(ctx, `SELECT count(*) FROM `+instances+` WHERE id = 'same'`).Scan(&rows)
	if n := owned(); n != relay.NumShards || rows != 1 {
		t.Fatalf("after A stopped: B's shards owned %d of %d, instance rows %d (want 1)", n, relay.NumShards, rows)
	}
}

// The goodbye still happens when the id is this relay's: a stopped relay
// hands its shards back and removes its instance row.
func TestStoppedRelayHandsBackItsShards(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	shards := pgx.Identifier{b.schema, "relay_shards"}.Sanitize()
	instances := pgx.Identifier{b.schema, "relay_instances"}.Sanitize()
	owned := func() (n int) {
		_ = b.pool.QueryRow(ctx, `SELECT count(*) FROM `+shards+` WHERE owner = 'mine'`).Scan(&n)
		return n
	}
	_, stop := b.startRelay(t, relay.Config{InstanceID: "mine", LeaseDuration: 30 * time.Second})
	waitFor(t, "the relay to own shards", 20*time.Second, func() bool { return owned() > 0 })
	stop()
	var rows int
	_ = b.pool.QueryRow(ctx, `SELECT count(*) FROM `+instances+` WHERE id = 'mine'`).Scan(&rows)
	if n := owned(); n != 0 || rows != 0 {
		t.Fatalf("after stop: shards owned %d, instance rows %d (want 0, 0)", n, rows)
	}
}
