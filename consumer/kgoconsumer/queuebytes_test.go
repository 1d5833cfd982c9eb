package kgoconsumer_test

import (
	"bytes"
	"context"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

func heapMB() float64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return float64(m.HeapAlloc) / (1 << 20)
}

// TestBufferedAheadIsBoundedInBytes (cold review, helper 96): a consumer
// catching up on a topic of 1 MiB messages, its handler slow (here blocked
// on the first message). The adapter moves what franz-go fetched into the
// partition's queue, Config.QueueSize messages (1,024 by default) whatever
// their size, and fetches on until it is full, so franz-go's own memory
// bound (FetchMaxBytes, 50 MB) no longer holds: observed +199 MiB of heap
// for a 200-message backlog of one partition, that is the whole backlog;
// 1 GiB per partition at the default, 32 GiB for a member catching up on
// 32 such partitions. Neither QueueSize's doc nor README says what it
// costs in memory for large messages. kafkagoconsumer queued the same way.
// Now consumer.Config.QueueBytes (4 MiB by default) bounds what a
// partition holds ahead of its handler; the adapter pauses the partition
// when it is reached.
func TestBufferedAheadIsBoundedInBytes(t *testing.T) {
	k := kafkatest.New(t)
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	limit := "8388608"
	topic := "h96-buf-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	k.CreateTopic(t, topic, 1, map[string]*string{"max.message.bytes": &limit})
	cl := k.Client(t, kgo.ProducerBatchMaxBytes(8<<20), kgo.ProducerBatchCompression(kgo.NoCompression()))
	for i := 0; i < 200; i++ {
		v := bytes.Repeat([]byte{byte(i)}, 1<<20)
		if err := cl.ProduceSync(context.Background(), &kgo.Record{Topic: topic, Value: v,
			Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte(strconv.Itoa(i))}}}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	release := make(chan struct{})
	p, err := consumer.New(pool, "h96-buf", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}, &consumer.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	c, err := kgoconsumer.New(p, &kgoconsumer.Config{Brokers: k.Brokers, Topics: []string{topic}, Group: "g"})
	if err != nil {
		t.Fatal(err)
	}
	before := heapMB()
	runInBackground(t, c)
	time.Sleep(8 * time.Second)
	after := heapMB()
	close(release)
	t.Logf("heap grew by %.0f MiB (%.0f to %.0f)", after-before, before, after)
	if after-before > 64 {
		t.Errorf("heap grew by %.0f MiB (%.0f to %.0f) in 8 s while the handler held its first message of 200 x 1 MiB: the whole backlog was fetched ahead",
			after-before, before, after)
	}
}

// TestMessageLargerThanQueueBytesIsProcessed: messages each larger than
// consumer.Config.QueueBytes are taken one at a time, never held back for
// good.
func TestMessageLargerThanQueueBytesIsProcessed(t *testing.T) {
	k := kafkatest.New(t)
	topic := k.Topic(t, 1)
	cl := k.Client(t)
	const n = 5
	for i := 0; i < n; i++ {
		if err := cl.ProduceSync(context.Background(), &kgo.Record{Topic: topic, Value: bytes.Repeat([]byte{'x'}, 64<<10),
			Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte(strconv.Itoa(i))}}}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	var seen atomic.Int64
	p, err := consumer.New(pgtest.Pool(t), "qb-large", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		seen.Add(1)
		return nil
	}, &consumer.Config{Schema: pgtest.Schema(t), QueueBytes: 1 << 10})
	if err != nil {
		t.Fatal(err)
	}
	c, err := kgoconsumer.New(p, &kgoconsumer.Config{Brokers: k.Brokers, Topics: []string{topic}, Group: "g", CommitInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := runInBackground(t, c)
	if got := waitCommitted(t, k, done, "g", topic, n, 30*time.Second); got != n {
		t.Fatalf("committed offset %d after 30 s, want %d (%d messages handled)", got, n, seen.Load())
	}
	if seen.Load() != n {
		t.Fatalf("%d messages handled, want %d", seen.Load(), n)
	}
}
