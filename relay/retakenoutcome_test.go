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

// A relay's record of a dead letter stalls on its connection (a failover,
// a frozen write) while its lease ticks stall too, past the lease. Another
// relay takes the shards; the topic's limit was raised meanwhile, and it
// publishes the key's first and second events, but stalls before deleting
// them, past its own lease. The first relay's ticks come back and take the
// shards again: same instance id, same token, a live lease. Then its
// stalled record runs. Checked against the owner's id, its lease and its
// instance token, it moved the first event to outbox_dead though the other
// relay had published it: both dead-lettered and published (G7), and a
// replay would put it after the second (G3). A record must act only under
// the take it read its round under.
//
// Two ways: the dead letter's own statement stalls (checked in the
// database), or the record of the round before it does, and the dead
// letter's record starts only after the retake (checked before it is
// sent).
func TestAStalledOutcomeDoesNotDeadLetterAcrossALostAndRetakenShard(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name  string
		stall string // the statement of r0's that stalls
		batch int
		msgs  []outbox.Message
	}{
		{"its own statement stalls", `"outbox_dead" (outbox_id, event_id`, 0, nil},
		// One event a round: the record of A's round stalls, and the
		// first event's round, read and refused meanwhile, waits for it.
		{"the round before it stalls", `lo = $2 AND hi = $3`, 1,
			[]outbox.Message{{Topic: "t", Key: []byte("A"), Value: []byte("a")}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			stalledOutcomeAcrossARetake(t, c.stall, c.batch, c.msgs)
		})
	}
}

func stalledOutcomeAcrossARetake(t *testing.T, stall string, batch int, before []outbox.Message) {
	b := setup(t)
	b.write(t, append(before,
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("first")},
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("second")},
	)...)
	pub := &settlingPublisher{refuse: map[string]bool{"first": true}, hang: map[string]bool{}, hung: make(chan struct{})}
	cfg := relay.Config{Schema: b.schema, InstanceID: "r0", LeaseDuration: 600 * time.Millisecond, PublishTimeout: 200 * time.Millisecond,
		MaxRetryBackoff: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond, BatchSize: batch}

	// r0: a record stalls on its connection.
	var g sqlGates
	record := g.add(stall)
	ticks := g.add(`AS i (id, hostname, pid, lease_until, token`)
	record.shutNow()
	r0 := runGated(t, &g, pub, cfg)
	waitFor(t, "r0 to stall recording an outcome", 30*time.Second, closed(record.held))
	waitFor(t, "r0 to be refused the first event", 30*time.Second, func() bool { return pub.refusedCount() > 0 })

	// Its lease ticks stall too, until its leases lapse.
	ticks.shutNow()
	waitFor(t, "r0's leases to lapse", 30*time.Second, func() bool { return len(r0.OwnedShards()) == 0 && b.lapsed(t, "r0") })
	pub.setRefused("first", false)

	// b takes the shards and publishes the key's events; its statements
	// stall as it records that, past its lease.
	bStall := newStallAtBatch("lo = $2 AND hi = $3")
	bStall.armed.Store(true)
	other := cfg
	other.InstanceID, other.BatchSize = "b", 0 // one round: it stalls recording it
	_, stopB := b.startRelayWith(t, pgtest.TracedPool(t, bStall, 4), pub, other)
	waitFor(t, "b to publish both events and stall", 30*time.Second, func() bool {
		return closed(bStall.stalled)() && slices.Contains(pub.writtenValues(), "second")
	})
	waitFor(t, "b's leases to lapse", 30*time.Second, func() bool { return b.lapsed(t, "b") })

	// r0's ticks come back: it takes the shards again.
	ticks.openUp()
	waitFor(t, "r0 to own the shards again", 30*time.Second, func() bool { return len(r0.OwnedShards()) == relay.NumShards })

	// Its stalled record runs now.
	record.openUp()
	waitFor(t, "r0's stalled record to run", 30*time.Second, closed(record.ended))
	close(bStall.release)
	waitFor(t, "the outbox to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	stopB()

	written := firstPublications(pub.writtenValues())
	if i, j := slices.Index(written, "first"), slices.Index(written, "second"); i < 0 || j < i {
		t.Errorf("first publications %v: want first, then second (G3)", written)
	}
	wantNoneBothDeadAndPublished(t, b, written, "r0's record, stalled across the loss and retake of its shards, moved it after b published it")
}

// lapsed reports whether the instance's lease in relay_instances has
// lapsed.
func (b *bundle) lapsed(t *testing.T, instance string) bool {
	t.Helper()
	var lapsed bool
	err := b.pool.QueryRow(context.Background(), `SELECT lease_until <= now() FROM `+pgx.Identifier{b.schema, "relay_instances"}.Sanitize()+` WHERE id = $1`, instance).Scan(&lapsed)
	if err != nil {
		t.Fatal(err)
	}
	return lapsed
}
