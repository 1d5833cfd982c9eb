package relay_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/relay"
)

// (Helper 109.) The dead letter's checks (owner, live lease, epoch, token)
// are read from the statement's snapshot, with now() the start of the
// record's transaction: they held only at that instant, as nothing locked
// the shards' rows. Once deadSQL has run, the record's transaction can stay
// open (here: failSQL, the next statement of the same batch, waits on the
// row of a failed event that another session holds locked, an operator's
// open transaction, say) while its relay is cut off and its leases lapse.
// The moved event is still pending to every other session until the
// commit: another relay took the shards (takeSQL skipped no row of
// relay_shards: none was locked), read the event and published it (its
// topic's limit was raised). Then the lock went, the record committed, and
// the event was both published and in outbox_dead (G7). Now the dead
// letter's shards stay locked until the record commits, and no relay takes
// them meanwhile.
func TestADeadLetterDoesNotCommitAfterItsShardWasTakenAndTheEventPublished(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	// Another session holds the failed event's row locked.
	lockTx, pub := lockedDeadLetterSetup(t, b)
	cfg := lockedRecordConfig(b, 600*time.Millisecond)
	// r0's record moves "first" (uncommitted) and waits on the lock; r0
	// is cut off: its ticks stall, its leases lapse.
	cutOffWhileItsRecordWaits(t, b, pub, cfg)
	pub.set("first", false)
	pub.set("f", false)

	other := cfg
	other.InstanceID = "b"
	_, stopB := b.startRelayWith(t, b.pool, pub, other)
	// b publishes the key's events if it can take their shard: for five
	// leases at most (it cannot while r0's record holds the shard).
	for deadline := time.Now().Add(5 * cfg.LeaseDuration); time.Now().Before(deadline) && !slices.Contains(pub.writtenValues(), "second"); {
		time.Sleep(20 * time.Millisecond)
	}

	// The lock goes: r0's record commits.
	if err := lockTx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the outbox to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	stopB()

	written := firstPublications(pub.writtenValues())
	wantNoneBothDeadAndPublished(t, b, written, "r0's dead letter, checked before its leases lapsed, committed after b took the shards and published it")
}

// refuseFailPublisher refuses the values in refuse as too large and fails
// those in fail with a passing error, as one partition would (a key's
// later records are not sent).
type refuseFailPublisher struct {
	mu      sync.Mutex
	refuse  map[string]bool
	fail    map[string]bool
	written []string
}

func (p *refuseFailPublisher) Publish(_ context.Context, records []relay.Record) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return publishLikeAPartition(records, func(r relay.Record) (error, bool) {
		switch {
		case p.refuse[string(r.Value)]:
			return relay.ErrRecordTooLarge, false
		case p.fail[string(r.Value)]:
			return errors.New("broker busy"), false
		}
		return nil, true
	}, func(v string) { p.written = append(p.written, v) })
}

func (p *refuseFailPublisher) set(v string, on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refuse[v] = on && p.refuse[v]
	p.fail[v] = on && p.fail[v]
}

func (p *refuseFailPublisher) writtenValues() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.written...)
}

func (*refuseFailPublisher) Close() error { return nil }

// A record holding its dead letters' shards locked (above) must not hold
// them for as long as an operator's lock it waits on lasts: with its relay
// frozen, no cancel comes from the client, and no relay could take those
// shards meanwhile. The record gives up after a lease (lock_timeout), its
// events left pending, and the shards can be taken: after five leases,
// the record's own 30 s timeout at the default lease.
func TestADeadLetterWaitingOnALockDoesNotKeepItsShardsFromOtherRelays(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	lockTx, pub := lockedDeadLetterSetup(t, b)
	cfg := lockedRecordConfig(b, 600*time.Millisecond)
	cutOffWhileItsRecordWaits(t, b, pub, cfg) // r0 is cut off from here on

	other := cfg
	other.InstanceID = "b"
	relayB, stopB := b.startRelayWith(t, b.pool, pub, other)
	// Well before the record's own 30 s timeout, with the lock still held.
	waitFor(t, "b to take every shard while the operator's lock is held", 10*time.Second, func() bool {
		return len(relayB.OwnedShards()) == relay.NumShards
	})
	if err := lockTx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	pub.set("f", false)
	waitFor(t, "f and second to be published", 30*time.Second, func() bool {
		return slices.Contains(pub.writtenValues(), "f") && slices.Contains(pub.writtenValues(), "second")
	})
	stopB()
}
