package relay_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
	"github.com/onceflow/onceflow/relay/relaytest"
)

// One sick partition of four, many distinct keys: every round carries some
// new key of the sick partition. The relay learns the partition is sick
// once (not one key at a time): later rounds hold its keys back without
// waiting on them, so the healthy partitions' events all go out promptly:
// within 25 s with a 5 s PublishTimeout, where each round waiting it out
// (as before the fix: 613 of 757 in 25 s) takes at least 10 rounds x 5 s. Then each key gets a second event, the partition heals,
// and every event reaches Kafka, each key's second after its first (G3),
// none dead-lettered (G7). Both publishers.
func TestSickPartitionWithManyKeysCostsOnlyItsKeys(t *testing.T) {
	t.Parallel()
	publishers := map[string]func(b *bundle, t *testing.T) relay.Publisher{
		"franz-go": func(b *bundle, t *testing.T) relay.Publisher { return b.publisher(t) },
		"kafka-go": func(b *bundle, t *testing.T) relay.Publisher {
			pub, err := kafkagopublisher.New(b.kafka.Brokers, nil)
			if err != nil {
				t.Fatal(err)
			}
			return pub
		},
	}
	for _, name := range []string{"franz-go", "kafka-go"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			runSickPartitionWithManyKeys(t, b, publishers[name](b, t))
		})
	}
}

func runSickPartitionWithManyKeys(t *testing.T, b *bundle, pub relay.Publisher) {
	fake := b.kafka.RequireFake(t)
	topic := b.kafka.Topic(t, 4)
	h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Partitions: []int32{0}, Err: kerr.NotEnoughReplicas, Count: -1})
	// Keyless events among them: the partitioner may put them on the
	// sick partition; they must not make the rounds wait either.
	const n, keyless = 1000, 50
	healthy := 0
	msgs := make([]outbox.Message, 0, n+keyless)
	for i := range n {
		key := []byte(fmt.Sprint("key-", i))
		if relaytest.JavaPartition(key, 4) != 0 {
			healthy++
		}
		msgs = append(msgs, outbox.Message{Topic: topic, Key: key, Value: []byte(fmt.Sprint(i, "/first"))})
		if i%(n/keyless) == 0 {
			msgs = append(msgs, outbox.Message{Topic: topic, Value: []byte(fmt.Sprint(i, "/keyless"))})
		}
	}
	b.write(t, msgs...)
	obs := &sickObserver{}
	b.startRelayWith(t, b.pool, pub, relay.Config{BatchSize: 100, PublishTimeout: 5 * time.Second, Observer: obs})
	start := time.Now()
	keyed, keylessGot := readKeyed(t, b, topic, healthy, 25*time.Second)
	t.Logf("%d of %d healthy-partition keyed events in %s (and %d of %d keyless by then)", keyed, healthy, time.Since(start).Round(time.Millisecond), keylessGot, keyless)
	if keyed < healthy {
		t.Fatalf("healthy keys did not go on at full speed: %d of %d in 25s (10 rounds x 5s timeout)", keyed, healthy)
	}
	if h.Hits() == 0 {
		t.Fatal("the fault was never hit; the test proves nothing")
	}
	waitFor(t, "the sick partition to be reported", 30*time.Second, func() bool { return obs.maxSick() == 1 && obs.heldBack() > 0 })

	// Second events for every key, then the partition heals.
	msgs = msgs[:0]
	for i := range n {
		msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint("key-", i)), Value: []byte(fmt.Sprint(i, "/second"))})
	}
	b.write(t, msgs...)
	h.Remove()
	waitFor(t, "the outbox to drain once the partition healed", 60*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	if d := b.count(t, "outbox_dead"); d != 0 {
		t.Fatalf("%d events dead-lettered for a passing broker error", d)
	}
	all := b.kafka.ReadAll(t, topic, 2*n+keyless, 30*time.Second)
	first, keylessSeen := map[string]bool{}, map[string]bool{}
	for _, r := range all {
		i, which, _ := strings.Cut(string(r.Value), "/")
		switch which {
		case "first":
			first[i] = true
		case "keyless":
			keylessSeen[i] = true
		case "second":
			if !first[i] {
				t.Fatalf("key-%s: its second event reached Kafka before its first (G3)", i)
			}
		}
	}
	if len(first) != n || len(keylessSeen) != keyless {
		t.Fatalf("%d of %d keys' first events and %d of %d keyless events reached Kafka", len(first), n, len(keylessSeen), keyless)
	}
	if obs.sickNow() != 0 {
		t.Fatalf("%d partitions still marked sick after the drain", obs.sickNow())
	}
}

// readKeyed reads topic until it holds want keyed records or timeout
// passes, and returns how many keyed and keyless records it read. A keyed
// record of partition 0 (the sick one) fails the test.
func readKeyed(t *testing.T, b *bundle, topic string, want int, timeout time.Duration) (keyed, keyless int) {
	t.Helper()
	cl := b.kafka.Client(t, kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for keyed < want {
		fetches := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			break
		}
		for _, r := range fetches.Records() {
			switch {
			case r.Key == nil:
				keyless++
			case r.Partition == 0:
				t.Fatalf("record %s of the sick partition reached Kafka while it is sick", r.Value)
			default:
				keyed++
			}
		}
	}
	return keyed, keyless
}

// sickObserver records what the relay reports about sick partitions.
type sickObserver struct {
	mu                  sync.Mutex
	held, maxSk, lastSk int
	changes             int // the sum of SickPartitionsChanged
}

func (o *sickObserver) ObserveBatch(s relay.BatchStats) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.held += s.HeldBack
	o.maxSk = max(o.maxSk, s.SickPartitions)
	o.lastSk = s.SickPartitions
	if !s.SickPartitionsReported {
		panic("the relay did not report the changes to a SickPartitionObserver")
	}
}

// SickPartitionsChanged: every change, a sick mark dropped at a round's
// start too (relay.SickPartitionObserver).
func (o *sickObserver) SickPartitionsChanged(delta int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.changes += delta
}

func (o *sickObserver) ObserveShards(int) {}

func (o *sickObserver) heldBack() int { o.mu.Lock(); defer o.mu.Unlock(); return o.held }
func (o *sickObserver) maxSick() int  { o.mu.Lock(); defer o.mu.Unlock(); return o.maxSk }
func (o *sickObserver) sickNow() int  { o.mu.Lock(); defer o.mu.Unlock(); return o.lastSk }

// sickReported is the sum of the changes the relay reported.
func (o *sickObserver) sickReported() int { o.mu.Lock(); defer o.mu.Unlock(); return o.changes }
