package relay_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
	"github.com/onceflow/onceflow/relay/relayprom"
)

func sickGauge(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "onceflow_relay_sick_partitions" {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("onceflow_relay_sick_partitions not registered")
	return 0
}

// sickTopic makes a one-partition topic whose writes kfake refuses with
// NOT_ENOUGH_REPLICAS (an ISR below min.insync.replicas) until heal is
// called, and writes one event to it (key "k").
func (b *bundle) sickTopic(t *testing.T) (topic string, heal func()) {
	t.Helper()
	fake := b.kafka.RequireFake(t)
	topic = b.kafka.Topic(t, 1)
	h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.NotEnoughReplicas, Count: -1})
	b.write(t, outbox.Message{Topic: topic, Key: []byte("k"), Value: []byte("held")})
	return topic, h.Remove
}

// plainWrapper is a third-party Observer that wraps another and does not
// pass SickPartitionsChanged on.
type plainWrapper struct{ next relay.Observer }

func (w plainWrapper) ObserveBatch(s relay.BatchStats) { w.next.ObserveBatch(s) }
func (w plainWrapper) ObserveShards(n int)             { w.next.ObserveShards(n) }

// Two relays (two schemas) in one process share one relayprom Observer (its
// metrics register once per registry). Relay A holds a partition sick; relay
// B, healthy, starts and publishes. Whatever the gauge means with a shared
// Observer (a sum, or this process's sick partitions), A's sick partition
// is still there: B's start must not wipe it to 0.
func TestSickGaugeSharedObserverKeepsAnotherRelaysCount(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	obs := relayprom.NewObserver(reg)

	a := setup(t)
	a.sickTopic(t)
	a.startRelay(t, relay.Config{PublishTimeout: 500 * time.Millisecond, Observer: obs})
	waitFor(t, "relay A to report its partition sick", 30*time.Second, func() bool { return sickGauge(t, reg) == 1 })

	b := setup(t)
	okTopic := b.kafka.Topic(t, 1)
	b.write(t, outbox.Message{Topic: okTopic, Key: []byte("k"), Value: []byte("v")})
	b.startRelay(t, relay.Config{PublishTimeout: 500 * time.Millisecond, Observer: obs})
	waitFor(t, "relay B to publish", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })

	if a.count(t, "outbox") != 1 {
		t.Fatal("relay A's event was published: its partition is not sick any more")
	}
	if g := sickGauge(t, reg); g != 1 {
		t.Fatalf("onceflow_relay_sick_partitions = %g while relay A still holds its partition sick, want 1", g)
	}
}

// Relay A reaches the shared relayprom Observer directly; relay B through a
// wrapper that does not pass SickPartitionsChanged on, so its count can
// only reach the gauge through BatchStats. A's start sets relayprom's
// sickDirect flag for the whole Observer, and B's BatchStats are ignored
// from then on: the gauge reads 0 with B's only partition sick.
func TestSickGaugeBatchStatsFallbackNotStarvedByAnotherRelay(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	obs := relayprom.NewObserver(reg)

	a := setup(t)
	a.write(t, outbox.Message{Topic: a.kafka.Topic(t, 1), Key: []byte("k"), Value: []byte("v")})
	a.startRelay(t, relay.Config{PublishTimeout: 500 * time.Millisecond, Observer: obs})
	waitFor(t, "relay A to publish", 30*time.Second, func() bool { return a.count(t, "outbox") == 0 })

	b := setup(t)
	b.sickTopic(t)
	b.startRelay(t, relay.Config{PublishTimeout: 500 * time.Millisecond, Observer: plainWrapper{obs}})
	waitFor(t, "relay B's event to fail three times", 60*time.Second, func() bool {
		var n int
		_ = b.pool.QueryRow(t.Context(), `SELECT coalesce(max(attempts), 0) FROM "`+b.schema+`".outbox`).Scan(&n)
		return n >= 3
	})
	if g := sickGauge(t, reg); g != 1 {
		t.Fatalf("onceflow_relay_sick_partitions = %g with relay B's only partition sick (B behind a wrapper: BatchStats is its only path), want 1", g)
	}
}

// A Relay runs once: a supervisor that restarts it in-process builds a new
// Relay on the same relayprom Observer (its metrics can be registered only
// once). The stopped relay must take back the sick partition it reported:
// the gauge kept its count while the new relay published to the healed
// partition.
func TestSickGaugeIsNotLeftOverFromAStoppedRelay(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic, heal := b.sickTopic(t)

	reg := prometheus.NewRegistry()
	obs := relayprom.NewObserver(reg)
	_, stop := b.startRelay(t, relay.Config{PublishTimeout: 500 * time.Millisecond, Observer: obs})
	waitFor(t, "the partition to be reported sick", 30*time.Second, func() bool { return sickGauge(t, reg) == 1 })
	stop()

	heal()
	b.startRelay(t, relay.Config{PublishTimeout: 500 * time.Millisecond, Observer: obs})
	b.write(t, outbox.Message{Topic: topic, Key: []byte("k2"), Value: []byte("healthy")})
	waitFor(t, "the new relay to publish both events", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	if g := sickGauge(t, reg); g != 0 {
		t.Fatalf("onceflow_relay_sick_partitions = %g on a relay with no sick partition that just published to the topic", g)
	}
}

// helper 115: sick-partition marks are dropped by an ack, by the round's
// forgetUnprobedSick, or when Run ends. A relay holding no shard runs no
// round: one that marked a partition sick and then stood aside (cut off
// from Kafka while another relay reaches it) kept reporting it sick, for
// good, while the other relay published to it.
func TestSickGaugeOfARelayThatHandedItsShardsOverIsCleared(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fake := b.kafka.RequireFake(t)
	topic := b.kafka.Topic(t, 1)
	heal := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.NotEnoughReplicas, Count: -1}).Remove
	// Shard 62 (of 0-255): A keeps it when it first hands its upper half
	// to B, so its mark outlives that and the rounds A runs until it
	// stands aside.
	b.write(t, outbox.Message{Topic: topic, Key: []byte("b"), Value: []byte("held")})
	reg := prometheus.NewRegistry()
	cut := &cutOffKgo{Publisher: b.publisher(t)}
	cfg := relay.Config{PublishTimeout: 500 * time.Millisecond, KafkaHandoff: time.Second}
	cfgA := cfg
	cfgA.InstanceID, cfgA.Observer = "a", relayprom.NewObserver(reg)
	a, _ := b.startRelayWith(t, b.pool, cut, cfgA)
	waitFor(t, "relay A to report its partition sick", 30*time.Second, func() bool { return sickGauge(t, reg) == 1 })

	cut.cut.Store(true)
	cfgB := cfg
	cfgB.InstanceID = "b"
	b.startRelay(t, cfgB)
	waitFor(t, "relay A to hand every shard over", 30*time.Second, func() bool { return len(a.OwnedShards()) == 0 })
	heal()
	waitFor(t, "relay B to publish the event", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	time.Sleep(2 * time.Second) // a few of A's lease ticks
	if g := sickGauge(t, reg); g != 0 {
		t.Fatalf("onceflow_relay_sick_partitions = %g on relay A, which holds no shard (another relay published to the partition)", g)
	}
}

// cutOffKgo is cutOffPublisher keeping every optional interface of the
// franz-go publisher (the partition a record goes to, which sick marks
// need); while cut, a publish times out, as to brokers that do not answer.
type cutOffKgo struct {
	*kgopublisher.Publisher
	cut atomic.Bool
}

func (p *cutOffKgo) Publish(ctx context.Context, records []relay.Record) []error {
	if !p.cut.Load() {
		return p.Publisher.Publish(ctx, records)
	}
	<-ctx.Done() // nothing answers: the publish times out
	errs := make([]error, len(records))
	for i := range errs {
		errs[i] = ctx.Err()
	}
	return errs
}

func (p *cutOffKgo) Ping(ctx context.Context) error {
	if p.cut.Load() {
		return errCutOff
	}
	return p.Publisher.Ping(ctx)
}
