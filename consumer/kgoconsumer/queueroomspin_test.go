package kgoconsumer_test

import (
	"bytes"
	"context"
	"fmt"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestAPausedPartitionFullByCountDoesNotSpin (cold review, helper 104):
// a partition whose queue is full by count (QueueSize messages) with its
// bytes just under half of QueueBytes, its handler busy. Each dispatch's
// TryAdd reserves the next message's bytes, finds the channel full and
// gives them back through taken(), which sees the bytes "fall" below half
// and calls QueueRoom: the poll loop's 20 ms wait is cut short at once, the
// next TryAdd fails the same way, and the poll loop spins for as long as
// the handler is busy. At the defaults (QueueSize 1024, QueueBytes 4 MiB)
// it takes messages of about 2 KiB; here QueueSize 4 and QueueBytes 1000
// with 110-byte messages (4 x 110 < 500 <= 5 x 110).
func TestAPausedPartitionFullByCountDoesNotSpin(t *testing.T) {
	k := kafkatest.New(t)
	topic := k.Topic(t, 1)
	cl := k.Client(t)
	for i := 0; i < 20; i++ {
		id := fmt.Sprintf("%02d", i)
		v := bytes.Repeat([]byte{'x'}, 110-len(consumer.MessageIDHeader)-len(id))
		if err := cl.ProduceSync(context.Background(), &kgo.Record{Topic: topic, Value: v,
			Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte(id)}}}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	release := make(chan struct{})
	var started atomic.Bool
	p, err := consumer.New(pgtest.Pool(t), "queue-spin", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		started.Store(true)
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}, &consumer.Config{Schema: pgtest.Schema(t), QueueSize: 4, QueueBytes: 1000})
	if err != nil {
		t.Fatal(err)
	}
	c, err := kgoconsumer.New(p, &kgoconsumer.Config{Brokers: k.Brokers, Topics: []string{topic}, Group: "g"})
	if err != nil {
		t.Fatal(err)
	}
	runInBackground(t, c)
	defer close(release)
	for deadline := time.Now().Add(20 * time.Second); !started.Load(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the handler never started")
		}
	}
	time.Sleep(time.Second) // the queue fills and the partition is paused
	const window = 2 * time.Second
	before := cpuTime()
	time.Sleep(window)
	used := cpuTime() - before
	t.Logf("process CPU time over %s while the handler held its message: %s", window, used)
	if used > window/4 {
		t.Errorf("process used %s of CPU in %s while the one partition was paused with a busy handler: the poll loop spins (QueueRoom on every failed TryAdd)", used, window)
	}
}
