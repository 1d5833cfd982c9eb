package consumer_test

import (
	"bytes"
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

// wakeCounter is a memTransport that counts QueueRoom calls.
type wakeCounter struct {
	memTransport
	wakes atomic.Int64
}

func (w *wakeCounter) QueueRoom() { w.wakes.Add(1) }

// TestAFailedTryAddDoesNotWakeTheAdapter (cold review, helper 104):
// QueueRoom says the queue has room again. A TryAdd that finds the
// channel full (QueueSize reached) gives back the bytes it reserved
// through taken(), which calls QueueRoom when the give-back takes the
// bytes from at or above half of QueueBytes to below it: every failed
// attempt wakes the adapter, which (kgoconsumer) cuts its poll short and
// calls TryAdd again, failing the same way, for as long as the handler is
// busy: a busy loop. Here QueueSize 2, QueueBytes 100, 20-byte messages:
// with two queued (40 bytes) each TryAdd of a third fails and wakes.
func TestAFailedTryAddDoesNotWakeTheAdapter(t *testing.T) {
	b := setup(t)
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	p, err := consumer.New(b.pool, "queue-room", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		select {
		case started <- struct{}{}:
		default:
		}
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}, &consumer.Config{Schema: b.schema, QueueSize: 2, QueueBytes: 100})
	if err != nil {
		t.Fatal(err)
	}
	m := func(i int) consumer.Message {
		id := fmt.Sprintf("%d", i)
		return consumer.Message{Topic: "t", Offset: int64(i), Value: bytes.Repeat([]byte{'x'}, 20-len(consumer.MessageIDHeader)-len(id)),
			Headers: []consumer.Header{{Key: consumer.MessageIDHeader, Value: []byte(id)}}}
	}
	tr := &wakeCounter{}
	w := p.StartPartition(context.Background(), tr)
	defer w.Stop(context.Background())
	defer close(release)
	if n := w.TryAdd([]consumer.Message{m(0)}); n != 1 {
		t.Fatalf("TryAdd took %d", n)
	}
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("handler never started")
	}
	if n := w.TryAdd([]consumer.Message{m(1), m(2)}); n != 2 {
		t.Fatalf("TryAdd took %d of 2 into an empty queue of 2", n)
	}
	before := tr.wakes.Load()
	for i := 0; i < 100; i++ {
		if n := w.TryAdd([]consumer.Message{m(3)}); n != 0 {
			t.Fatalf("TryAdd took %d into a full queue", n)
		}
	}
	if got := tr.wakes.Load() - before; got != 0 {
		t.Errorf("100 TryAdd into a full queue, each taking nothing, called QueueRoom %d times: the adapter is told there is room when there is none, and kgoconsumer's poll loop spins", got)
	}
}
