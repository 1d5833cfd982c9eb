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

// A partition marked sick whose probe's event leaves without an
// acknowledgement (here it is refused for good and dead-lettered; a shard
// handed over does the same) must still be probed: once the partition
// takes writes again, the mark clears, and the topic's keyless events go
// out in the rounds again instead of being held back for ever.
func TestSickMarkClearsWhenItsProbeIsDeadLettered(t *testing.T) {
	b := setup(t)
	fake := b.kafka.RequireFake(t)
	topic := b.kafka.Topic(t, 4)
	sick := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Partitions: []int32{0}, Err: kerr.NotEnoughReplicas, Count: -1})
	var key []byte
	for i := 0; key == nil; i++ {
		if k := []byte(fmt.Sprint("probe-", i)); relaytest.JavaPartition(k, 4) == 0 {
			key = k
		}
	}
	b.write(t, outbox.Message{Topic: topic, Key: key, Value: []byte("probe")})
	obs := &sickObserver{}
	b.startRelayWith(t, b.pool, b.publisher(t), relay.Config{PublishTimeout: 2 * time.Second, Observer: obs})
	waitFor(t, "the partition to be marked sick", 30*time.Second, func() bool { return obs.maxSick() == 1 })
	// The probe's event is refused for good: dead-lettered (G7 allows it).
	sick.Remove()
	refuse := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Partitions: []int32{0}, Err: kerr.MessageTooLarge, Count: -1})
	waitFor(t, "the probe's event to be dead-lettered", 60*time.Second, func() bool { return b.count(t, "outbox_dead") == 1 })
	refuse.Remove() // the partition takes writes again
	msgs := make([]outbox.Message, 40)
	for i := range msgs {
		msgs[i] = outbox.Message{Topic: topic, Value: []byte(fmt.Sprint("keyless-", i))}
	}
	b.write(t, msgs...)
	waitFor(t, "the keyless events to drain", 60*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	heldBefore := obs.heldBack()
	b.write(t, msgs...)
	waitFor(t, "the keyless events to drain again", 60*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	if n := obs.sickNow(); n != 0 || obs.heldBack() > heldBefore {
		t.Fatalf("partition healthy again, yet %d partition(s) still reported sick and %d keyless events held back from the rounds since", n, obs.heldBack()-heldBefore)
	}
}
