package relay_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// A relay hands shards back while a lease tick runs: the tick's renewal
// reaches the database before the hand-back commits, so it renews the
// shards being handed back, and installs its result only after the
// hand-back is done. The relay must not take those shards back in memory:
// the relay that takes them in the database publishes their events, and
// this one would publish them too (helper 85 saw 182 of 400 events
// published twice). The test hook holds each goroutine at that point.
func TestReleasedShardsStayReleasedWhenATickRenewedThem(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	shardsT := pgx.Identifier{b.schema, "relay_shards"}.Sanitize()
	topic := b.kafka.Topic(t, 4)

	var (
		releasing, renewed, released, installed               = make(chan struct{}), make(chan struct{}), make(chan struct{}), make(chan struct{})
		onceRelease, onceRenewed, onceReleased, onceInstalled sync.Once
		ownedAfter                                            atomic.Int64
		stuck                                                 atomic.Value // string: a wait that timed out
	)
	ownedAfter.Store(-1)
	closed := func(ch chan struct{}) bool {
		select {
		case <-ch:
			return true
		default:
			return false
		}
	}
	wait := func(ch chan struct{}, what string) {
		select {
		case <-ch:
		case <-time.After(10 * time.Second):
			stuck.CompareAndSwap(nil, what)
		}
	}
	var rA atomic.Pointer[relay.Relay]
	hook := func(point string) {
		switch point {
		case "release": // the hand-back is about to be sent: a tick renews first
			onceRelease.Do(func() { close(releasing); wait(renewed, "a tick's renewal") })
		case "renewed": // that tick installs its result after the hand-back
			if closed(releasing) {
				onceRenewed.Do(func() { close(renewed); wait(released, "the hand-back") })
			}
		case "released": // and the publish loop reads the shards after that
			if closed(renewed) {
				onceReleased.Do(func() {
					close(released)
					wait(installed, "the tick's result")
					ownedAfter.Store(int64(len(rA.Load().OwnedShards())))
				})
			}
		case "installed":
			if closed(released) {
				onceInstalled.Do(func() { close(installed) })
			}
		}
	}
	a, _ := b.startHookedRelay(t, b.pool, b.publisher(t), relay.Config{InstanceID: "a", LeaseDuration: time.Second}, hook)
	rA.Store(a)
	waitFor(t, "A to own every shard", 20*time.Second, func() bool { return len(a.OwnedShards()) == relay.NumShards })

	b.startRelay(t, relay.Config{InstanceID: "b", LeaseDuration: time.Second})
	select {
	case <-releasing:
	case <-time.After(20 * time.Second):
		t.Fatal("A never handed shards back")
	}
	// While A's hand-back waits: events on every shard, those it hands
	// back included.
	var msgs []outbox.Message
	for i := range 400 {
		msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprintf("k%03d", i)), Value: []byte("v")})
	}
	b.write(t, msgs...)

	waitFor(t, "the interleaving", 20*time.Second, func() bool { return ownedAfter.Load() >= 0 || stuck.Load() != nil })
	if what := stuck.Load(); what != nil {
		t.Fatalf("the interleaving did not happen: waited in vain for %s", what)
	}
	var ownedA int
	if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM `+shardsT+` WHERE owner = 'a'`).Scan(&ownedA); err != nil {
		t.Fatal(err)
	}
	if got := ownedAfter.Load(); got > int64(ownedA) {
		t.Errorf("after the hand-back A's OwnedShards() holds %d shards, relay_shards gives A %d", got, ownedA)
	}

	waitFor(t, "the outbox to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	recs := b.kafka.ReadAll(t, topic, len(msgs), 5*time.Second)
	seen := map[string]int{}
	for _, r := range recs {
		seen[messageID(r)]++
	}
	dups := 0
	for _, n := range seen {
		if n > 1 {
			dups++
		}
	}
	if len(seen) != len(msgs) {
		t.Fatalf("distinct events in Kafka %d, want %d", len(seen), len(msgs))
	}
	if dups > 0 {
		t.Fatalf("%d of %d events published twice in a graceful hand-back (A published shards it had handed back)", dups, len(msgs))
	}
}
