package consumer_test

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

// TestALargeMessageDoesNotWaitForABusyKeysParkedMessage (cold review,
// helper 104): key-parallel mode (Concurrency 4), key A's handler is slow
// (an outside call; here blocked), and A's next message waits behind it.
// Then comes a message of key B larger than QueueBytes, then one of key
// C. A message larger than the bound is taken only when nothing is
// counted as queued, and A's waiting message counts until A's handler
// finishes: B's message waits for A's slow handler, and every key behind
// it (C) with it, though three lanes are idle. Before QueueBytes, B and C
// ran at once; with it, one slow key and one large message stall the
// partition for as long as the slow handler runs.
func TestALargeMessageDoesNotWaitForABusyKeysParkedMessage(t *testing.T) {
	b := setup(t)
	release := make(chan struct{})
	var mu sync.Mutex
	handled := map[string]bool{}
	p, err := consumer.New(b.pool, "queue-keys", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		mu.Lock()
		handled[string(m.Key)+"/"+m.ID] = true
		mu.Unlock()
		if string(m.Key) == "A" {
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
		return nil
	}, &consumer.Config{Schema: b.schema, Concurrency: 4, QueueBytes: 1000})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	w := p.StartPartition(context.Background(), tr)
	defer w.Stop(context.Background())
	defer close(release)
	big := msg(2, "b1", "B")
	big.Value = bytes.Repeat([]byte{'x'}, 2000)
	msgs := []consumer.Message{msg(0, "a1", "A"), msg(1, "a2", "A"), big, msg(3, "c1", "C")}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = w.Add(ctx, msgs...) }()
	seen := func(k string) bool { mu.Lock(); defer mu.Unlock(); return handled[k] }
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) && !(seen("B/b1") && seen("C/c1")) {
		time.Sleep(20 * time.Millisecond)
	}
	if !seen("B/b1") || !seen("C/c1") {
		t.Errorf("after 5 s with key A's handler busy: key B's large message handled %v, key C's %v; want both (three lanes idle): they wait for A's handler, whose next message counts as queued", seen("B/b1"), seen("C/c1"))
	}
}

// What lets a large message past a busy key's parked ones must not let a
// busy key's own large messages pile up: once parked messages hold the
// bound, nothing more is taken until they leave.
func TestABusyKeysLargeMessagesDoNotPileUp(t *testing.T) {
	b := setup(t)
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	p, err := consumer.New(b.pool, "queue-keys-pile", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		select {
		case started <- struct{}{}:
		default:
		}
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}, &consumer.Config{Schema: b.schema, Concurrency: 4, QueueBytes: 1000})
	if err != nil {
		t.Fatal(err)
	}
	w := p.StartPartition(context.Background(), &memTransport{})
	defer w.Stop(context.Background())
	defer close(release)
	if n := w.TryAdd([]consumer.Message{msg(0, "a0", "A")}); n != 1 {
		t.Fatalf("TryAdd took %d of A's first message", n)
	}
	<-started
	var large []consumer.Message
	for i := 1; i <= 5; i++ {
		m := msg(int64(i), fmt.Sprint("a", i), "A")
		m.Value = bytes.Repeat([]byte{'x'}, 2000)
		large = append(large, m)
	}
	took := 0
	for range 20 {
		took += w.TryAdd(large[took:])
		time.Sleep(20 * time.Millisecond)
	}
	if took > 1 {
		t.Fatalf("%d of key A's 2,000-byte messages were taken behind its busy handler with QueueBytes 1,000; want 1 (the bound, plus one message over it)", took)
	}
}
