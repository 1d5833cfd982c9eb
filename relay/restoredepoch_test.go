package relay_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// (Helper 109.) The epoch check of a dead letter (migration 13) relies on
// a shard's epoch never coming back to a value it had. Counted from the
// row's (epoch + 1), it did: restoreShardsSQL writes a deleted row of
// relay_shards back with epoch 0 (the column's default), and the count
// starts again. r0 holds the shards under their second take
// (epoch 2) when its record of a dead letter stalls, and so do its lease
// ticks, past its lease. The rows of relay_shards are deleted by hand (the
// case restoreShardsSQL is there for); b writes them back (epoch 0), takes
// them (epoch 1), publishes the key's first and second events (the topic's
// limit was raised meanwhile) and stalls recording that, past its lease.
// r0's ticks take the shards back: epoch 2 again, its own id, a live lease,
// its token. Its stalled record moves the first event to outbox_dead,
// though b published it (G7; a replay puts it after the second, G3).
func TestAStalledDeadLetterDoesNotMoveAnEventAcrossRestoredShardRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	shardsTable := pgx.Identifier{b.schema, "relay_shards"}.Sanitize()
	// Every shard was taken once before r0 takes it (an earlier relay, or
	// r0's own earlier take): r0's take is the second.
	if _, err := b.pool.Exec(ctx, `UPDATE `+shardsTable+` SET epoch = 1`); err != nil {
		t.Fatal(err)
	}
	b.write(t,
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("first")},
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("second")},
	)
	pub := &settlingPublisher{refuse: map[string]bool{"first": true}, hang: map[string]bool{}, hung: make(chan struct{})}
	cfg := relay.Config{Schema: b.schema, InstanceID: "r0", LeaseDuration: 600 * time.Millisecond, PublishTimeout: 200 * time.Millisecond,
		MaxRetryBackoff: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond}

	var g sqlGates
	record := g.add(`"outbox_dead" (outbox_id, event_id`)
	ticks := g.add(`AS i (id, hostname, pid, lease_until, token`)
	record.shutNow()
	r0 := runGated(t, &g, pub, cfg)
	waitFor(t, "r0 to stall recording the dead letter", 30*time.Second, closed(record.held))

	ticks.shutNow()
	waitFor(t, "r0's leases to lapse", 30*time.Second, func() bool { return len(r0.OwnedShards()) == 0 && b.lapsed(t, "r0") })
	pub.setRefused("first", false)

	// The rows of relay_shards are deleted by hand.
	if _, err := b.pool.Exec(ctx, `DELETE FROM `+shardsTable); err != nil {
		t.Fatal(err)
	}

	// b writes them back, takes them, publishes both events and stalls
	// recording that, past its lease.
	bStall := newStallAtBatch("lo = $2 AND hi = $3")
	bStall.armed.Store(true)
	other := cfg
	other.InstanceID = "b"
	_, stopB := b.startRelayWith(t, pgtest.TracedPool(t, bStall, 4), pub, other)
	waitFor(t, "b to publish both events and stall", 30*time.Second, func() bool {
		return closed(bStall.stalled)() && slices.Contains(pub.writtenValues(), "second")
	})
	waitFor(t, "b's leases to lapse", 30*time.Second, func() bool { return b.lapsed(t, "b") })

	// r0 takes the shards back (with a count of takes from the row's,
	// their epoch would be 2 again).
	ticks.openUp()
	waitFor(t, "r0 to own the shards again", 30*time.Second, func() bool { return len(r0.OwnedShards()) == relay.NumShards })

	record.openUp()
	waitFor(t, "r0's stalled record to run", 30*time.Second, closed(record.ended))
	close(bStall.release)
	waitFor(t, "the outbox to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	stopB()

	written := firstPublications(pub.writtenValues())
	wantNoneBothDeadAndPublished(t, b, written, "relay_shards' rows were written back at epoch 0, and r0's retake brought the epoch back to the one its stalled record checks")
}
