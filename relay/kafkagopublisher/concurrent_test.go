package kafkagopublisher_test

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
)

// The relay's two concurrent Publish calls (round + side retry, e8821ad)
// share one kafka.Writer: the round's wave for a partition is appended to a
// batch already holding the side retry's records, overflows it, and the key's
// records land in two batches. The first exhausts MaxAttempts on a sick
// partition; the second is written: K's event 2 reaches Kafka, event 1 not.
func TestConcurrentPublishCallsDoNotShareBatches(t *testing.T) {
	k := kafkatest.New(t)
	fake := k.RequireFake(t)
	topic := k.Topic(t, 1)
	tr := &kafka.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	p, err := kafkagopublisher.New(k.Brokers, &kafkagopublisher.Config{Transport: tr, BatchTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Warm metadata so both calls go straight to the partition writer.
	if errs := p.Publish(ctx, []relay.Record{{Topic: topic, Key: []byte("warm"), Value: []byte("w")}}); errs[0] != nil {
		t.Fatal(errs[0])
	}
	h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.NotEnoughReplicas, Count: 5}) // MaxAttempts 5
	val := func(c byte, n int) []byte { return append([]byte{c}, bytes.Repeat([]byte("x"), n)...) }
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the side retry: another key, same partition
		defer wg.Done()
		p.Publish(ctx, []relay.Record{{Topic: topic, Key: []byte("J"), Value: val('j', 500<<10)}})
	}()
	time.Sleep(50 * time.Millisecond)
	errs := p.Publish(ctx, []relay.Record{ // the round: key K, one wave
		{Topic: topic, Key: []byte("K"), Value: val('1', 400<<10)},
		{Topic: topic, Key: []byte("K"), Value: val('2', 200<<10)},
	})
	wg.Wait()
	t.Logf("fault hits %d, errs %v", h.Hits(), errs)
	got := k.ReadAll(t, topic, 3, 5*time.Second)
	seen1 := false
	for _, r := range got {
		switch r.Value[0] {
		case '1':
			seen1 = true
		case '2':
			if !seen1 {
				t.Fatalf("K's record 2 reached Kafka before record 1 (errs: %v)", errs)
			}
		}
	}
}
