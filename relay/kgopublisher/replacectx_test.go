package kgopublisher_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

// Publish must return when ctx is done (relay.Publisher; the relay bounds
// each call with PublishTimeout, and a stop with stopGrace). A refusal seen
// in a produce response while another partition's request is in flight to a
// slow broker makes Publish flush the refused client for up to 10 s after
// its ctx ended.
func TestPublishReturnsAtCtxAfterRefusal(t *testing.T) {
	k := kafkatest.New(t, kfake.NumBrokers(2))
	fake := k.RequireFake(t)
	topic := k.Topic(t, 2)
	if err := fake.MoveTopicPartition(topic, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := fake.MoveTopicPartition(topic, 1, 1); err != nil {
		t.Fatal(err)
	}
	p, err := kgopublisher.New(k.Brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	warm, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if errs := p.Publish(warm, []relay.Record{{Topic: topic, Key: []byte("w"), Value: []byte("w")}}); errs[0] != nil {
		t.Fatal(errs[0])
	}
	keys := map[int32][]byte{}
	for i := 0; len(keys) < 2 && i < 100; i++ {
		key := []byte(fmt.Sprint("k", i))
		if part, ok := p.Partition(topic, key); ok && keys[part] == nil {
			keys[part] = key
		}
	}
	// Warm both partitions' producer state.
	if errs := p.Publish(warm, []relay.Record{{Topic: topic, Key: keys[0], Value: []byte("0")}, {Topic: topic, Key: keys[1], Value: []byte("1")}}); errs[0] != nil || errs[1] != nil {
		t.Fatal(errs)
	}

	release := make(chan struct{})
	defer close(release)
	fake.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		fake.KeepControl()
		if fake.CurrentNode() == 1 { // partition 1's leader: slow
			fake.SleepControl(func() { <-release })
		}
		return nil, nil, false
	})
	fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Nodes: []int32{0}, Err: kerr.ClusterAuthorizationFailed, Count: -1})

	ctx, cancel2 := context.WithTimeout(context.Background(), time.Second)
	defer cancel2()
	start := time.Now()
	errs := p.Publish(ctx, []relay.Record{{Topic: topic, Key: keys[0], Value: []byte("a")}, {Topic: topic, Key: keys[1], Value: []byte("b")}})
	took := time.Since(start)
	t.Logf("Publish with a 1 s ctx returned after %s: %v", took.Round(10*time.Millisecond), errs)
	if took > 3*time.Second {
		t.Errorf("Publish returned %s after its ctx (1 s) ended; the contract says it returns when ctx is done", (took - time.Second).Round(10*time.Millisecond))
	}
}
