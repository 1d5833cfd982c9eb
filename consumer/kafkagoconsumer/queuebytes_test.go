package kafkagoconsumer_test

import (
	"bytes"
	"context"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kafkagoconsumer"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

func heapMiB() float64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return float64(m.HeapAlloc) / (1 << 20)
}

// TestBufferedAheadIsBoundedInBytes: a consumer catching up on 200 × 1 MiB
// messages of one partition, its handler holding the first. The fetcher
// queues what it fetched until consumer.Config.QueueBytes (4 MiB by
// default) waits, not QueueSize (1,024) messages whatever their size: the
// heap grows by a few fetches' worth, not by the backlog (+190 MiB before
// QueueBytes, cold review of kgoconsumer, helper 96). Once released, every
// message is processed.
func TestBufferedAheadIsBoundedInBytes(t *testing.T) {
	k := kafkatest.New(t)
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	limit := "8388608"
	topic := "qb-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	k.CreateTopic(t, topic, 1, map[string]*string{"max.message.bytes": &limit})
	cl := k.Client(t, kgo.ProducerBatchMaxBytes(8<<20), kgo.ProducerBatchCompression(kgo.NoCompression()))
	const n = 200
	for i := 0; i < n; i++ {
		v := bytes.Repeat([]byte{byte(i)}, 1<<20)
		if err := cl.ProduceSync(context.Background(), &kgo.Record{Topic: topic, Value: v,
			Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte(strconv.Itoa(i))}}}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	var done atomic.Int64
	p, err := consumer.New(pool, "qb", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		select {
		case started <- struct{}{}:
		default:
		}
		select {
		case <-release:
		case <-ctx.Done():
			return ctx.Err()
		}
		done.Add(1)
		return nil
	}, &consumer.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	c, err := kafkagoconsumer.New(p, &kafkagoconsumer.Config{Reader: kafka.ReaderConfig{
		Brokers: k.Brokers, GroupID: "g", GroupTopics: []string{topic},
		MaxBytes: 2 << 20, MaxWait: 200 * time.Millisecond, StartOffset: kafka.FirstOffset,
	}})
	if err != nil {
		t.Fatal(err)
	}
	before := heapMiB()
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- c.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-ran; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		close(release)
		t.Fatal("the handler got no message in 30 s")
	}
	time.Sleep(5 * time.Second) // time for the fetcher to run ahead
	after := heapMiB()
	close(release)
	t.Logf("heap grew by %.0f MiB (%.0f to %.0f) while the handler held its first message of %d x 1 MiB", after-before, before, after, n)
	if after-before > 32 {
		t.Errorf("heap grew by %.0f MiB (%.0f to %.0f) while the handler held its first message of %d x 1 MiB: the backlog was fetched ahead",
			after-before, before, after, n)
	}
	for deadline := time.Now().Add(60 * time.Second); done.Load() < n && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
	}
	if got := done.Load(); got != n {
		t.Fatalf("%d of %d messages processed", got, n)
	}
}
