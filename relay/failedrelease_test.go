package relay_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
)

// failFirstRelease fails the first hand-back (releaseSQL) before it is
// sent: a database blip at the wrong moment.
type failFirstRelease struct{ failed atomic.Bool }

func (f *failFirstRelease) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "SET owner = NULL, lease_until = NULL WHERE owner = $1 AND shard = ANY") && f.failed.CompareAndSwap(false, true) {
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		return cancelled
	}
	return ctx
}

func (*failFirstRelease) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// handBackFrom256 starts relay "a" on a pool traced by tracer, reporting to
// the returned observer, waits until it owns every shard, then starts relay
// "b": a hands back its excess (128 shards).
func handBackFrom256(t *testing.T, tracer pgx.QueryTracer) (relay.Config, *relay.Relay, *shardsObserver) {
	t.Helper()
	b := setup(t)
	cfg := relay.Config{Schema: b.schema, LeaseDuration: 600 * time.Millisecond, PollInterval: 20 * time.Millisecond}
	obs := &shardsObserver{}
	cfgA := cfg
	cfgA.InstanceID, cfgA.Observer = "a", obs
	a, _ := b.startRelayOn(t, pgtest.TracedPool(t, tracer, 4), cfgA)
	waitFor(t, "a to own every shard", 10*time.Second, func() bool { return len(a.OwnedShards()) == relay.NumShards })
	cfgB := cfg
	cfgB.InstanceID = "b"
	b.startRelay(t, cfgB)
	return cfg, a, obs
}

// helper 115: releaseExcess trims the shards it hands back from the
// relay's own set before it sends the hand-back, but reported the new count
// (ObserveShards) only when the statement succeeded. After a failed one the
// next ticks changed nothing the report depends on, so
// onceflow_relay_owned_shards stayed at the old count (256 for a relay that
// now publishes 128) until ownership changed again, and its sum across
// relays was above 256.
func TestOwnedShardsAreReportedAfterAFailedHandBack(t *testing.T) {
	t.Parallel()
	fail := &failFirstRelease{}
	cfg, a, obs := handBackFrom256(t, fail)
	waitFor(t, "a's hand-back to fail", 10*time.Second, func() bool { return fail.failed.Load() })
	time.Sleep(3 * cfg.LeaseDuration) // a few lease ticks
	if owned, reported := len(a.OwnedShards()), obs.owned.Load(); int64(owned) != reported {
		t.Fatalf("a owns %d shards but reports %d after a failed hand-back", owned, reported)
	}
}

// outageDuringRelease holds the first hand-back (releaseSQL) until told,
// then fails it; from the moment it is held until heal, every other
// statement fails at once (the database unreachable), so the lease ticks
// fail and the leases lapse meanwhile.
type outageDuringRelease struct {
	held, release chan struct{}
	once          sync.Once
	down          atomic.Bool
}

func (o *outageDuringRelease) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "SET owner = NULL, lease_until = NULL WHERE owner = $1 AND shard = ANY") {
		first := false
		o.once.Do(func() { first = true })
		if first {
			o.down.Store(true)
			close(o.held)
			<-o.release
			return cancelledContext(ctx)
		}
	}
	if o.down.Load() {
		return cancelledContext(ctx)
	}
	return ctx
}

func (*outageDuringRelease) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func cancelledContext(ctx context.Context) context.Context {
	c, cancel := context.WithCancel(ctx)
	cancel()
	return c
}

// The failed hand-back's report must not undo the report of lapsed leases:
// a hand-back that hung while the database was unreachable, and failed
// after the leases lapsed (reported 0), reported the trimmed count (128),
// and the lapse, reported once, was not reported again: the relay showed
// 128 shards for the rest of the outage.
func TestAFailedHandBackAfterTheLeasesLapsedReportsNoShard(t *testing.T) {
	t.Parallel()
	outage := &outageDuringRelease{held: make(chan struct{}), release: make(chan struct{})}
	cfg, _, obs := handBackFrom256(t, outage)
	t.Cleanup(func() { // before the relays stop: a's held hand-back must end
		outage.down.Store(false)
		select {
		case <-outage.release:
		default:
			close(outage.release)
		}
	})
	<-outage.held
	waitFor(t, "a's leases to be reported lapsed", 10*time.Second, func() bool { return obs.owned.Load() == 0 })
	close(outage.release) // the hand-back fails, the database still unreachable
	time.Sleep(3 * cfg.LeaseDuration)
	if n := obs.owned.Load(); n != 0 {
		t.Fatalf("a reports %d shards while its leases are lapsed (the database unreachable)", n)
	}
}
