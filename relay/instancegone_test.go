package relay_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// An operator deletes a live relay's relay_instances row (it looked stale
// in `onceflow status`, say), and the relay is stopped gracefully before
// its next heartbeat writes the row back. The stop still hands its shards
// back (helper 85 saw them stay leased to the stopped relay, their events
// waiting for the leases to lapse), forgets its rounds and leaves no
// instance row.
func TestGracefulStopHandsBackShardsAfterInstanceRowDeleted(t *testing.T) {
	ctx := context.Background()
	t.Run("another relay takes them at once", func(t *testing.T) {
		b := setup(t)
		shards := pgx.Identifier{b.schema, "relay_shards"}.Sanitize()
		instances := pgx.Identifier{b.schema, "relay_instances"}.Sanitize()
		topic := b.kafka.Topic(t, 4)
		owned := func(id string) (n int) {
			_ = b.pool.QueryRow(ctx, `SELECT count(*) FROM `+shards+` WHERE owner = $1 AND lease_until > now()`, id).Scan(&n)
			return n
		}
		_, stopA := b.startRelay(t, relay.Config{InstanceID: "a", LeaseDuration: 30 * time.Second})
		waitFor(t, "A to own every shard", 20*time.Second, func() bool { return owned("a") == relay.NumShards })
		b.startRelay(t, relay.Config{InstanceID: "b", LeaseDuration: time.Second})
		waitFor(t, "the shards to be shared", 30*time.Second, func() bool { return owned("a") == 128 && owned("b") == 128 })

		if _, err := b.pool.Exec(ctx, `DELETE FROM `+instances+` WHERE id = 'a'`); err != nil {
			t.Fatal(err)
		}
		stopA() // within A's 10 s lease interval: its heartbeat has not written the row back
		stopped := time.Now()
		if n := owned("a"); n != 0 {
			t.Errorf("after A's graceful stop %d shards are still leased to A, want 0", n)
		}
		var msgs []outbox.Message
		for i := range 100 {
			msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprintf("k%03d", i)), Value: []byte("v")})
		}
		b.write(t, msgs...)
		waitFor(t, "B to publish every event (A's 30 s leases not waited for)", 5*time.Second, func() bool { return b.count(t, "outbox") == 0 })
		if recs := b.kafka.ReadAll(t, topic, len(msgs), 5*time.Second); len(recs) != len(msgs) {
			t.Fatalf("records %d, want %d", len(recs), len(msgs))
		}
		t.Logf("outbox drained %.1fs after A's stop", time.Since(stopped).Seconds())
	})
	t.Run("its rounds and instance row go", func(t *testing.T) {
		b := setup(t)
		shards := pgx.Identifier{b.schema, "relay_shards"}.Sanitize()
		instances := pgx.Identifier{b.schema, "relay_instances"}.Sanitize()
		rounds := pgx.Identifier{b.schema, "relay_rounds"}.Sanitize()
		_, stopA := b.startRelay(t, relay.Config{InstanceID: "a", LeaseDuration: 30 * time.Second})
		waitFor(t, "A to own every shard", 20*time.Second, func() bool { return len(ownedBy(t, b, "a")) == relay.NumShards })
		// A round A read ahead and never sent, as a stop leaves it: its
		// relay_rounds row.
		for _, q := range []string{`DELETE FROM ` + instances + ` WHERE id = 'a'`,
			`INSERT INTO ` + rounds + ` (instance, lo, hi, shards) VALUES ('a', 1000001, 1000002, '{1}')`} {
			if _, err := b.pool.Exec(ctx, q); err != nil {
				t.Fatal(err)
			}
		}
		stopA()
		var left, rows, n int
		_ = b.pool.QueryRow(ctx, `SELECT count(*) FROM `+shards+` WHERE owner IS NOT NULL`).Scan(&left)
		_ = b.pool.QueryRow(ctx, `SELECT count(*) FROM `+rounds+` WHERE instance = 'a'`).Scan(&n)
		_ = b.pool.QueryRow(ctx, `SELECT count(*) FROM `+instances+` WHERE id = 'a'`).Scan(&rows)
		if left != 0 || n != 0 || rows != 0 {
			t.Fatalf("after A's graceful stop: shards owned %d, A's relay_rounds rows %d, instance rows %d (want 0, 0, 0)", left, n, rows)
		}
	})
}

// The same, but another process under the same instance id wrote the row
// back (it started meanwhile). It must not come to hold the shards A holds
// by renewing them (a renewal extends only its own takes: two processes
// under one id would both publish them); it waits for them to lapse or be
// handed back. Then the row is deleted again and A stops: the shards are
// still A's own, and it hands them back.
func TestGracefulStopAfterInstanceRowDeletedKeepsSameIDSuccessorsShards(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	instances := pgx.Identifier{b.schema, "relay_instances"}.Sanitize()
	_, stopA := b.startRelay(t, relay.Config{InstanceID: "a", LeaseDuration: 30 * time.Second})
	waitFor(t, "A to own every shard", 20*time.Second, func() bool { return len(ownedBy(t, b, "a")) == relay.NumShards })
	if _, err := b.pool.Exec(ctx, `DELETE FROM `+instances+` WHERE id = 'a'`); err != nil {
		t.Fatal(err)
	}
	from := time.Now()
	successor, _ := b.startRelay(t, relay.Config{InstanceID: "a", LeaseDuration: 30 * time.Second})
	waitFor(t, "the successor to write the instance row", 10*time.Second, func() bool {
		var n int
		_ = b.pool.QueryRow(ctx, `SELECT count(*) FROM `+instances+` WHERE id = 'a'`).Scan(&n)
		return n == 1
	})
	time.Sleep(2 * time.Second) // its first tick's renewal and take
	if n := len(successor.OwnedShards()); n != 0 {
		t.Fatalf("the successor under A's id holds %d shards A holds (renewed, not taken): both publish them", n)
	}
	if _, err := b.pool.Exec(ctx, `DELETE FROM `+instances+` WHERE id = 'a'`); err != nil {
		t.Fatal(err)
	}
	stopA()
	if time.Since(from) > 8*time.Second {
		t.Skip("too slow: A's lease tick may have run meanwhile")
	}
	if n := len(ownedBy(t, b, "a")); n != 0 {
		t.Fatalf("after A's graceful stop %d shards are still leased to id a, want 0: they were A's own", n)
	}
}

// ownedBy returns the shards leased to instance id now.
func ownedBy(t *testing.T, b *bundle, id string) []int16 {
	t.Helper()
	var out []int16
	if err := b.pool.QueryRow(context.Background(), `SELECT coalesce(array_agg(shard ORDER BY shard), '{}') FROM `+
		pgx.Identifier{b.schema, "relay_shards"}.Sanitize()+` WHERE owner = $1 AND lease_until > now()`, id).Scan(&out); err != nil {
		t.Fatal(err)
	}
	return out
}

// renewalAnswerLoser loses, once armed, the answer to the relay's next
// lease renewal: the renewal commits, the relay sees a broken connection.
type renewalAnswerLoser struct {
	armed atomic.Bool
	lost  chan struct{}
}

func (l *renewalAnswerLoser) TraceQueryStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "SET lease_until = now() + $2::interval") && l.armed.CompareAndSwap(true, false) {
		c := conn.PgConn().Conn().(*answerLosingConn)
		c.lost = l.lost
		c.lose.Store(true)
	}
	return ctx
}

func (*renewalAnswerLoser) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// As the first test, but the answer to A's last renewal was lost (it
// committed: the leases end later than A knows). A's shards are still its
// own take (same epoch), and its stop hands them back; checked by the
// lease's end, it left them leased to id a until they lapsed.
func TestGracefulStopAfterInstanceRowDeletedHandsBackShardsWhoseRenewalAnswerWasLost(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	instances := pgx.Identifier{b.schema, "relay_instances"}.Sanitize()
	loser := &renewalAnswerLoser{lost: make(chan struct{})}
	_, stopA := b.startRelayWith(t, answerLosingPool(t, loser, 4), b.publisher(t), relay.Config{InstanceID: "a", LeaseDuration: 30 * time.Second})
	waitFor(t, "A to own every shard", 20*time.Second, func() bool { return len(ownedBy(t, b, "a")) == relay.NumShards })
	loser.armed.Store(true)
	waitFor(t, "A's next renewal, its answer lost", 30*time.Second, closed(loser.lost))
	// A's next tick is a lease interval (10 s) away.
	if _, err := b.pool.Exec(ctx, `DELETE FROM `+instances+` WHERE id = 'a'`); err != nil {
		t.Fatal(err)
	}
	stopA()
	if n := len(ownedBy(t, b, "a")); n != 0 {
		t.Fatalf("after A's graceful stop %d shards are still leased to id a, want 0: they were A's own take", n)
	}
}
