package relay_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// sideGatePublisher publishes through pub, but holds the records of one key:
// its first call waits out the publish timeout (the key goes to the side
// retry), its second (the side retry) tells inFlight and waits for gate.
// It reports no partitions, so no partition is marked sick.
type sideGatePublisher struct {
	pub      relay.Publisher
	key      []byte
	inFlight chan struct{}
	gate     chan struct{}

	mu    sync.Mutex
	calls int
}

func (p *sideGatePublisher) Publish(ctx context.Context, records []relay.Record) []error {
	hasKey := false
	for _, r := range records {
		hasKey = hasKey || bytes.Equal(r.Key, p.key)
	}
	if hasKey {
		p.mu.Lock()
		p.calls++
		call := p.calls
		p.mu.Unlock()
		switch call {
		case 1:
			<-ctx.Done()
			errs := make([]error, len(records))
			for i := range errs {
				errs[i] = ctx.Err()
			}
			return errs
		case 2:
			close(p.inFlight)
			<-p.gate
		}
	}
	return p.pub.Publish(ctx, records)
}

func (p *sideGatePublisher) Close() error { return p.pub.Close() }

// A relay asked to hand shards back while a side retry of an event on one
// of them is with Kafka hands them back only once that retry's outcome is
// recorded. Handed back before, the retry's delete was refused (the shard
// was another relay's by then), and that relay published the event again.
func TestShardsAreHandedBackAfterTheSideRetryOnThem(t *testing.T) {
	b := setup(t)
	topic := b.kafka.Topic(t, 4)
	// A key of a shard A hands back: the upper half of its shards.
	var key []byte
	for i := 0; key == nil; i++ {
		if k := fmt.Appendf(nil, "key-%d", i); sha256.Sum256(k)[0] >= 128 {
			key = k
		}
	}
	pub := &sideGatePublisher{pub: b.publisher(t), key: key, inFlight: make(chan struct{}), gate: make(chan struct{})}
	var openGate sync.Once
	defer openGate.Do(func() { close(pub.gate) })
	a, _ := b.startRelayWith(t, b.pool, pub, relay.Config{InstanceID: "a", LeaseDuration: time.Second, PublishTimeout: 5 * time.Second})
	waitFor(t, "A to own every shard", 20*time.Second, func() bool { return len(a.OwnedShards()) == relay.NumShards })
	b.write(t, outbox.Message{Topic: topic, Key: key, Value: []byte("v")})
	select {
	case <-pub.inFlight:
	case <-time.After(20 * time.Second):
		t.Fatal("no side retry of the event that timed out")
	}

	bRelay, _ := b.startRelay(t, relay.Config{InstanceID: "b", LeaseDuration: time.Second})
	// A's tick asks it to hand back half its shards: give it the time to
	// (it must not, before the side retry ends).
	handedBack := func() bool { return len(ownedBy(t, b, "a")) <= relay.NumShards/2 }
	deadline := time.Now().Add(2 * time.Second)
	for !handedBack() && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	early := handedBack()
	openGate.Do(func() { close(pub.gate) })

	waitFor(t, "the outbox to drain", 20*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	waitFor(t, "A to hand back half its shards", 10*time.Second, func() bool {
		return handedBack() && len(bRelay.OwnedShards()) == relay.NumShards/2
	})
	recs := b.kafka.ReadAll(t, topic, 2, 3*time.Second)
	if len(recs) != 1 || early {
		t.Fatalf("the event was published %d times (want 1); shards handed back during the side retry: %v", len(recs), early)
	}
}
