package relay_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// A partition that cannot take writes (NOT_ENOUGH_REPLICAS for ever, as
// while its ISR is below min.insync.replicas) costs only the keys that land
// in it: the round's wait is bounded, the sick event is held back and
// retried (never dead-lettered, G7), every other key is published, and the
// sick event goes out once the partition heals.
func TestSickPartitionCostsOnlyItsKeys(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fake := b.kafka.RequireFake(t)
	sick := b.kafka.Topic(t, 1)
	healthy := b.kafka.Topic(t, 4)
	h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: sick, Err: kerr.NotEnoughReplicas, Count: -1})
	b.write(t, outbox.Message{Topic: sick, Key: []byte("sick"), Value: []byte("held")})
	const n = 5000
	msgs := make([]outbox.Message, 0, n)
	for i := range n {
		msgs = append(msgs, outbox.Message{Topic: healthy, Key: []byte(fmt.Sprint("k", i%97)), Value: []byte(fmt.Sprint(i))})
	}
	b.write(t, msgs...)

	obs := &countingObserver{}
	b.startRelay(t, relay.Config{PublishTimeout: 2 * time.Second, Observer: obs})
	start := time.Now()
	if got := b.kafka.ReadAll(t, healthy, n, 60*time.Second); len(got) < n {
		t.Fatalf("%d of %d events of healthy keys published in 60s beside one sick partition", len(got), n)
	}
	t.Logf("healthy events published in %s", time.Since(start))
	outboxTable := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	waitFor(t, "the sick event to be retried", 30*time.Second, func() bool {
		var attempts int
		err := b.pool.QueryRow(context.Background(), `SELECT attempts FROM `+outboxTable+` WHERE topic = $1`, sick).Scan(&attempts)
		return err == nil && attempts >= 2
	})
	if d := b.count(t, "outbox_dead"); d != 0 {
		t.Fatalf("%d events dead-lettered for a passing broker error", d)
	}
	if obs.timedOut() == 0 {
		t.Fatal("no publish timeout was reported to the Observer")
	}
	if h.Hits() == 0 {
		t.Fatal("the fault was never hit")
	}

	h.Remove()
	got := b.kafka.ReadAll(t, sick, 1, 60*time.Second)
	if len(got) == 0 || string(got[0].Value) != "held" {
		t.Fatalf("the held event was not published once the partition healed: %v", got)
	}
	waitFor(t, "the outbox to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	if d := b.count(t, "outbox_dead"); d != 0 {
		t.Fatalf("%d events dead-lettered", d)
	}
}

// countingObserver counts what the relay reports.
type countingObserver struct {
	mu    sync.Mutex
	stats relay.BatchStats // sums
}

func (o *countingObserver) ObserveBatch(s relay.BatchStats) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.stats.Published += s.Published
	o.stats.Failed += s.Failed
	o.stats.TimedOut += s.TimedOut
	o.stats.DeadLettered += s.DeadLettered
}

func (o *countingObserver) ObserveShards(int) {}

func (o *countingObserver) timedOut() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.stats.TimedOut
}

// A sick mark dropped at a round's start (its probe's event was
// dead-lettered, so no key waits on the partition any more) must reach the
// Observer even when that round reads nothing: onceflow_relay_sick_partitions
// stayed at 1 on an idle relay, since only rounds that read events were
// observed.
func TestADroppedSickMarkIsObservedOnAnIdleRelay(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sick, heal := b.sickTopic(t)

	obs := &sickObserver{}
	b.startRelay(t, relay.Config{PublishTimeout: 500 * time.Millisecond, Observer: obs})
	waitFor(t, "the partition to be reported sick", 30*time.Second, func() bool { return obs.sickReported() == 1 })

	// The partition now refuses the record for good: the probe's event is
	// dead-lettered, the outbox is empty, and nothing waits on the mark.
	b.kafka.RequireFake(t).Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: sick, Err: kerr.InvalidRecord, Count: -1})
	heal()
	waitFor(t, "the probe's event to be dead-lettered", 30*time.Second, func() bool { return b.count(t, "outbox_dead") == 1 })
	waitFor(t, "the Observer to learn the mark was dropped", 10*time.Second, func() bool { return obs.sickReported() == 0 })
	if n := b.count(t, "outbox"); n != 0 {
		t.Fatalf("%d events still pending", n)
	}
}
