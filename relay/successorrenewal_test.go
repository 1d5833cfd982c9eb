package relay_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
)

// (Helper 110.) The dead letter's FOR KEY SHARE lock on its shards' rows
// keeps out a take (FOR UPDATE SKIP LOCKED), but not a renewal: an UPDATE
// of lease_until alone takes FOR NO KEY UPDATE, which does not conflict
// with FOR KEY SHARE. And a renewal is how a successor process under the
// same instance id (a rescheduled pod keeps its name) comes to hold the
// shards of a predecessor whose shard leases outlive its instance row's
// (its last tick was slow between heartbeat and renewal: gapTracer). The
// token check (the instance row's token is the predecessor's) holds only
// at deadSQL's snapshot: nothing locks the instance row either.
//
// Scenario: r0 (process P) dead-letters K's "first" (too large); its
// record's transaction has run deadSQL (all checks pass, "first" deleted,
// uncommitted) and waits in failSQL on the row of a failed event ("f")
// that another session holds locked. P's last lease tick is slow between
// heartbeat and renewal, then P freezes: its instance row lapses 1.5 s
// before its shards' leases. The topic's limit is raised. Process Q is
// started under the same id "r0": its heartbeat takes the lapsed row (new
// token), its renewal renews the shards (owner "r0", leases live, no take:
// the locks do not stop it), it reads "first" (pending to every session
// but P's) and publishes it. The lock goes, P's record commits: "first"
// is published and in outbox_dead (G7).
func TestADeadLetterDoesNotCommitAfterASuccessorUnderItsIDRenewedTheShardsAndPublished(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	// Another session holds the failed event's row locked.
	lockTx, pub := lockedDeadLetterSetup(t, b)
	cfg := lockedRecordConfig(b, 3*time.Second)
	gap := &gapTracer{delay: 1500 * time.Millisecond, froze: make(chan struct{}), thaw: make(chan struct{})}
	p, err := relay.New(pgtest.TracedPool(t, gap, 4), pub, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	pctx, stopP := context.WithCancel(ctx)
	pdone := make(chan error, 1)
	go func() { pdone <- p.Run(pctx) }()
	t.Cleanup(func() {
		select {
		case <-gap.thaw:
		default:
			close(gap.thaw)
		}
		stopP()
		<-pdone // its id is Q's now: an InstanceInUseError is fine
	})

	// P's record has moved "first" (uncommitted) and waits on the lock.
	waitFor(t, "P's record to wait on the locked row after its dead letter", 30*time.Second, func() bool { return recordsWaitingOnALock(t, b) > 0 })
	recordStart := time.Now()

	// P's next tick is slow between heartbeat and renewal, then P freezes.
	gap.gap.Store(true)
	waitFor(t, "P's slow tick and freeze", 30*time.Second, closed(gap.froze))
	pub.set("first", false) // the topic's limit raised
	pub.set("f", false)

	// Q: the same instance id, another process.
	qcfg := cfg
	qcfg.LeaseDuration = 600 * time.Millisecond
	_, stopQ := b.startRelayWith(t, b.pool, pub, qcfg)
	// Q publishes K's events if it comes to hold their shard before P's
	// record ends (well within the record's 30 s).
	for deadline := recordStart.Add(20 * time.Second); time.Now().Before(deadline) && !slices.Contains(pub.writtenValues(), "second"); {
		time.Sleep(20 * time.Millisecond)
	}
	if recordsWaitingOnALock(t, b) == 0 {
		t.Log("P's record no longer waits on the lock (timed out?): the scenario did not play out")
	}

	// The lock goes: P's record commits.
	if err := lockTx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the outbox to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	stopQ()

	written := firstPublications(pub.writtenValues())
	wantNoneBothDeadAndPublished(t, b, written, "P's dead letter, checked (token, lease) before a successor under its id renewed the shards (a renewal is not kept out by FOR KEY SHARE), committed after the successor published it")
}
