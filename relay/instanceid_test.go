package relay_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// A second relay started under the InstanceID of a live one refuses to
// start with an error that says so, instead of owning every shard beside it
// and publishing every event twice.
func TestSecondRelayWithSameInstanceIDRefusesToStart(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 2)
	b.startRelay(t, relay.Config{InstanceID: "same"})
	waitFor(t, "the first relay to own its shards", 20*time.Second, func() bool {
		st, err := relay.ReadStatus(context.Background(), b.pool, b.schema)
		return err == nil && st.UnownedShards == 0
	})

	pub := b.publisher(t)
	defer pub.Close()
	second, err := relay.New(b.pool, pub, &relay.Config{Schema: b.schema, InstanceID: "same", LeaseDuration: time.Second, PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- second.Run(ctx) }()

	const n = 500
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = outbox.Message{Topic: topic, Key: []byte(fmt.Sprint(i % 13)), Value: []byte(fmt.Sprint(i))}
	}
	b.write(t, msgs...)

	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "instance id") || !strings.Contains(err.Error(), `"same"`) {
			t.Fatalf("second relay's Run: %v; want an error naming the instance id in use", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a second relay under the same InstanceID is still running after 30s")
	}
	waitFor(t, "the outbox to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	if got := b.kafka.ReadAll(t, topic, n+1, 3*time.Second); len(got) != n {
		t.Fatalf("%d records for %d events: the same instance id published twice", len(got), n)
	}
	st, err := relay.ReadStatus(context.Background(), b.pool, b.schema)
	if err != nil || st.UnownedShards != 0 {
		t.Fatalf("the first relay lost its shards: %+v, %v", st, err)
	}
}

// A relay restarted under the instance id of a killed one finds the dead
// relay's row still unexpired and waits for it to lapse. A lease tick that
// straddles the lapse and runs long (here: it waits on a lock a slow
// statement holds on the row; in production, a slow database) must not get
// it refused: nobody renews that row, so the id is not in use by a live
// relay. Only a holder whose heartbeat advances is (see
// TestSecondRelayWithSameInstanceIDRefusesToStart).
func TestRestartUnderADeadRelaysIDStartsAfterASlowTick(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	instances := pgx.Identifier{b.schema, "relay_instances"}.Sanitize()
	const lease = 3 * time.Second
	// The dead relay's last heartbeat, just before it was killed.
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+instances+` (id, hostname, pid, heartbeat_at, lease_until, token)
VALUES ('same', 'dead-host', 1, now(), now() + $1::interval, 'dead-token')`, lease.String()); err != nil {
		t.Fatal(err)
	}
	var lapse time.Time
	if err := b.pool.QueryRow(ctx, `SELECT lease_until FROM `+instances+` WHERE id = 'same'`).Scan(&lapse); err != nil {
		t.Fatal(err)
	}

	pub := b.publisher(t)
	defer pub.Close()
	r, err := relay.New(b.pool, pub, &relay.Config{Schema: b.schema, InstanceID: "same", LeaseDuration: lease, PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	var runErr error
	finished := make(chan struct{})
	go func() { defer close(finished); runErr = r.Run(rctx) }()
	defer func() {
		cancel()
		<-finished
	}()

	// Shortly before the lapse, a statement locks the dead relay's row
	// until well after it: the tick that starts meanwhile (they come every
	// lease/3) waits on the lock, and its heartbeat, whose now() is from
	// before the lapse, finds the row unexpired.
	waitFor(t, "shortly before the dead relay's lease lapses", 2*lease, func() bool { return time.Until(lapse) < 1200*time.Millisecond })
	tx, err := b.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT 1 FROM `+instances+` WHERE id = 'same' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a lease tick to wait on the row", 2*lease, func() bool {
		var n int
		_ = b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%relay_instances%'`, b.schema).Scan(&n)
		return n > 0
	})
	waitFor(t, "half a lease interval past the lapse", 3*lease, func() bool { return time.Since(lapse) > lease/2 })
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	waitFor(t, "the restarted relay to take the id and the shards", 20*time.Second, func() bool {
		select {
		case <-finished:
			return true
		default:
		}
		st, err := relay.ReadStatus(ctx, b.pool, b.schema)
		return err == nil && st.UnownedShards == 0
	})
	select {
	case <-finished:
		t.Fatalf("the relay restarted under a dead relay's id stopped: %v", runErr)
	default:
	}
	var token string
	if err := b.pool.QueryRow(ctx, `SELECT token FROM `+instances+` WHERE id = 'same'`).Scan(&token); err != nil || token == "dead-token" {
		t.Fatalf("the instance row is still the dead relay's: %q, %v", token, err)
	}
}
