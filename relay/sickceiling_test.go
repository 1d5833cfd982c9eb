package relay_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaytest"
)

// One partition of four is sick and holds more keys than MaxHeldKeys. The
// sick partition's keys must not stop the healthy partitions: their events,
// written after, reach Kafka while the partition stays sick.
func TestSickPartitionWithMoreKeysThanMaxHeldKeysDoesNotStallHealthyPartitions(t *testing.T) {
	b := setup(t)
	fake := b.kafka.RequireFake(t)
	topic := b.kafka.Topic(t, 4)
	h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Partitions: []int32{0}, Err: kerr.NotEnoughReplicas, Count: -1})
	defer h.Remove()
	const sickKeys, healthyEvents = 40, 200
	var msgs []outbox.Message
	for i := 0; len(msgs) < sickKeys; i++ {
		key := []byte(fmt.Sprint("sick-", i))
		if relaytest.JavaPartition(key, 4) == 0 {
			msgs = append(msgs, outbox.Message{Topic: topic, Key: key, Value: []byte("sick")})
		}
	}
	b.write(t, msgs...)
	msgs = msgs[:0]
	for i := 0; len(msgs) < healthyEvents; i++ {
		key := []byte(fmt.Sprint("healthy-", i))
		if relaytest.JavaPartition(key, 4) != 0 {
			msgs = append(msgs, outbox.Message{Topic: topic, Key: key, Value: []byte("healthy")})
		}
	}
	b.write(t, msgs...)
	b.startRelayWith(t, b.pool, b.publisher(t), relay.Config{BatchSize: sickKeys, MaxHeldKeys: 8, PublishTimeout: 2 * time.Second})
	keyed, _ := readKeyed(t, b, topic, healthyEvents, 45*time.Second)
	if keyed < healthyEvents {
		t.Fatalf("healthy partitions stalled behind a sick one: %d of %d healthy events in 45s", keyed, healthyEvents)
	}
}
