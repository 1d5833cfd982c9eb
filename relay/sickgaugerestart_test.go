package relay_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relayprom"
)

// A Relay runs once: a supervisor that restarts it in-process builds a new
// Relay on the same relayprom Observer (its metrics can be registered only
// once). The new Relay starts with no sick partition but never says so, and
// since d03a357 ObserveBatch no longer sets the gauge: it keeps the stopped
// relay's count while the new one publishes to the healed partition.
func TestSickGaugeIsNotLeftOverFromAStoppedRelay(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fake := b.kafka.RequireFake(t)
	topic := b.kafka.Topic(t, 1)
	h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.NotEnoughReplicas, Count: -1})
	b.write(t, outbox.Message{Topic: topic, Key: []byte("k"), Value: []byte("held")})

	reg := prometheus.NewRegistry()
	obs := relayprom.NewObserver(reg)
	gauge := func() float64 {
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
	_, stop := b.startRelay(t, relay.Config{PublishTimeout: 500 * time.Millisecond, Observer: obs})
	waitFor(t, "the partition to be reported sick", 30*time.Second, func() bool { return gauge() == 1 })
	stop()

	h.Remove()
	b.startRelay(t, relay.Config{PublishTimeout: 500 * time.Millisecond, Observer: obs})
	b.write(t, outbox.Message{Topic: topic, Key: []byte("k2"), Value: []byte("healthy")})
	waitFor(t, "the new relay to publish both events", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	if g := gauge(); g != 0 {
		t.Fatalf("onceflow_relay_sick_partitions = %g on a relay with no sick partition that just published to the topic", g)
	}
}
