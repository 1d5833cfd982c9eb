package relay_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// gapTracer, once gap is set, makes a relay's next lease tick slow between
// its heartbeat and its renewal (the charge of crashed rounds takes delay:
// a large outbox, a lock) and then freezes the relay's every statement (the
// process crashed or stalled) right after that renewal: its instance row's
// lease then ends delay before its shards' leases.
type gapTracer struct {
	gap     atomic.Bool
	delay   time.Duration
	gapping atomic.Bool
	frozen  atomic.Bool
	froze   chan struct{}
	thaw    chan struct{}
}

type gapRenewKey struct{}

func (g *gapTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if g.frozen.Load() {
		<-g.thaw
		return ctx
	}
	if g.gap.Load() && strings.HasPrefix(d.SQL, "WITH crashed AS") && strings.Contains(d.SQL, "i.lease_until > now()") {
		g.gap.Store(false)
		time.Sleep(g.delay)
		g.gapping.Store(true)
	}
	if g.gapping.Load() && strings.Contains(d.SQL, "relay_shards") && strings.Contains(d.SQL, "s.owner = $1 AND s.lease_until > now()") && strings.Contains(d.SQL, "SET lease_until") {
		return context.WithValue(ctx, gapRenewKey{}, true)
	}
	return ctx
}

func (g *gapTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if ctx.Value(gapRenewKey{}) != nil && g.frozen.CompareAndSwap(false, true) {
		close(g.froze)
	}
}

// The losses counter misses a takeover of the instance id and its return:
// the shards are leased to the instance id, and a renewal by any process
// under that id renews them, so a relay whose id was taken over (and then
// given up) while it stalled finds its shards "renewed without a break".
//
// Scenario: relay A (instance id "stalled") reads a round (K's "first" and
// "second") and its statements stall past its lease. Another process B is
// started under the same instance id (a rescheduled pod keeps its name):
// the row has lapsed, so B takes it, takes the shards, dead-letters
// "first" (too large) and publishes "second". B's last lease tick is slow
// between its heartbeat and its renewal (its charge of crashed rounds
// took a second), then B freezes (crashes): its instance row lapses a
// second before its shard leases. The topic's limit is raised. A's
// database comes back within that second: A's heartbeat takes the lapsed
// row back (a lapsed row goes to any token), its renewal renews the
// shards (owner "stalled", leases valid): kept, no loss counted, and
// validUntil moves on. A's stalled round resumes, passes
// stillHeld(losses) and publishes "first" after "second" (G3), an event
// also in outbox_dead.
//
// Suggested fix: count a loss whenever the heartbeat finds the instance
// row with another token (or absent) than this process's, i.e. the id was
// someone else's meanwhile (heartbeatSQL could return whether the token
// was already ours); and/or whenever a tick starts after validUntil (the
// leases may have lapsed meanwhile, whatever the next renewal says),
// which covers this case and the lost take's (losttake_test.go).
func TestAStalledRelayDoesNotPublishAfterItsInstanceIDWasTakenOverAndBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.write(t,
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("first")},
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("second")},
	)
	pub := &settlingPublisher{refuse: map[string]bool{"first": true}, hang: map[string]bool{}, hung: make(chan struct{})}
	stall := newTwoPhaseStall()
	stall.armed.Store(true)
	cfg := relay.Config{InstanceID: "stalled", LeaseDuration: 600 * time.Millisecond, PublishTimeout: 200 * time.Millisecond,
		MaxRetryBackoff: 50 * time.Millisecond}
	var installs atomic.Int32
	stalledRelay, stopStalled := b.startHookedRelay(t, answerLosingPool(t, stall, 4), pub, cfg, func(point string) {
		if point == "installed" {
			installs.Add(1)
		}
	})
	waitFor(t, "the stall", 30*time.Second, closed(stall.stalled))

	// B: the same instance id, another process.
	gap := &gapTracer{delay: time.Second, froze: make(chan struct{}), thaw: make(chan struct{})}
	bcfg := cfg
	bcfg.Schema, bcfg.PollInterval, bcfg.LeaseDuration = b.schema, 50*time.Millisecond, 3*time.Second
	successor, err := relay.New(pgtest.TracedPool(t, gap, 4), pub, &bcfg)
	if err != nil {
		t.Fatal(err)
	}
	bctx, stopB := context.WithCancel(context.Background())
	bdone := make(chan error, 1)
	go func() { bdone <- successor.Run(bctx) }()
	t.Cleanup(func() { // after A stopped: B finds its id taken, which is fine here
		stopB()
		select {
		case <-gap.thaw:
		default:
			close(gap.thaw)
		}
		<-bdone
	})
	waitFor(t, "the successor to settle both events", 30*time.Second, func() bool {
		return b.count(t, "outbox") == 0 && b.count(t, "outbox_dead") == 1
	})
	gap.gap.Store(true)
	waitFor(t, "the successor's slow tick and freeze", 30*time.Second, closed(gap.froze))
	instances := pgx.Identifier{b.schema, "relay_instances"}.Sanitize()
	waitFor(t, "the instance row to lapse", 30*time.Second, func() bool {
		var lapsed bool
		if err := b.pool.QueryRow(ctx, `SELECT lease_until <= now() FROM `+instances+` WHERE id = 'stalled'`).Scan(&lapsed); err != nil {
			t.Fatal(err)
		}
		return lapsed
	})
	pub.setRefused("first", false) // the topic's limit raised

	after := installs.Load()
	close(stall.releaseOthers) // A's lease ticks come back
	waitFor(t, "a tick of the stalled relay to install its leases", 30*time.Second, func() bool {
		return installs.Load() > after && len(stalledRelay.OwnedShards()) > 0
	})

	close(stall.releaseMark)
	b.waitRoundLetGo(t, "the stalled relay to let its round go", stall.marked, "stalled")
	stopStalled()

	wantOnlySecondWritten(t, pub, "the same instance id's other process dead-lettered the first event and published the second")
}
