package conformance

import (
	"context"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
)

// testStuckPartition: a handler stuck on one partition's message holds up
// that partition only; the other partitions of the same consumer go on to
// the end and commit it.
func testStuckPartition(t *testing.T, a Adapter) {
	e := setup(t, a)
	topic := e.k.Topic(t, 2)
	var recs []rec
	recs = append(recs, rec{id: "stuck", value: "stuck", partition: 0})
	for i := range 200 {
		recs = append(recs, rec{id: "p0-" + strconv.Itoa(i), value: "x", partition: 0})
	}
	e.produce(t, topic, recs...)
	release, entered := make(chan struct{}), make(chan struct{}, 1)
	p, err := consumer.New(e.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if string(m.Value) == "stuck" {
			select {
			case entered <- struct{}{}:
			default: // delivered again after a rebalance: must not block
			}
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return record(ctx, tx, e.effects, "ledger", m)
	}, &consumer.Config{Schema: e.schema, QueueSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	e.startWith(t, p, Options{}, "g", topic)
	t.Cleanup(func() { close(release) }) // runs before the consumer is stopped
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the stuck message never reached the handler")
	}
	// Partition 0 now has a full queue and more records behind it.
	recs = recs[:0]
	for i := range 60 {
		recs = append(recs, rec{id: "id-" + strconv.Itoa(i), value: "x", partition: 1})
	}
	e.produce(t, topic, recs...)
	waitFor(t, 60*time.Second, "partition 1 committed to its end while partition 0 is stuck", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		offs, err := e.k.Admin(t).FetchOffsets(ctx, e.group("g"))
		if err != nil {
			return false
		}
		o, ok := offs.Lookup(topic, 1)
		return ok && o.At == 60
	})
	if n := e.count(t, "part = 0"); n != 0 {
		t.Fatalf("partition 0 effects = %d, want 0 while its first message is stuck", n)
	}
}

// testMarkerShapedRecords: real records that happen to look like
// transaction markers (no headers, a 4-byte key 00 00 00 00 or 00 00 00
// 01, a 6-byte value starting 00 00) are messages like any other: they
// reach the handler, never skipped silently.
func testMarkerShapedRecords(t *testing.T, a Adapter) {
	e := setup(t, a)
	topic := e.k.Topic(t, 1)
	cl := e.k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rs := []*kgo.Record{
		{Topic: topic, Key: []byte{0, 0, 0, 1}, Value: []byte{0, 0, 0, 0, 0, 3}},
		{Topic: topic, Key: []byte{0, 0, 0, 0}, Value: []byte{0, 0, 0, 0, 0, 0}},
		{Topic: topic, Key: []byte("k"), Value: []byte("plain")},
	}
	if err := cl.ProduceSync(ctx, rs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	o := &outcomes{}
	p, err := consumer.New(e.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		// The effects table holds text.
		m.Key, m.Value = []byte(hex.EncodeToString(m.Key)), []byte(hex.EncodeToString(m.Value))
		return record(ctx, tx, e.effects, "ledger", m)
	}, &consumer.Config{
		Schema:    e.schema,
		Hooks:     []consumer.Hook{o},
		MessageID: func(m consumer.Message) (string, error) { return "id-" + strconv.FormatInt(m.Offset, 10), nil },
	})
	if err != nil {
		t.Fatal(err)
	}
	e.start(t, p, "g", topic)
	e.waitCommitted(t, "g", topic, 30*time.Second)
	e.exactlyOnce(t, "ledger", 3)
	if o.processed.Load() != 3 {
		t.Fatalf("processed %d, want 3", o.processed.Load())
	}
	if n := e.count(t, "key IN ('00000001', '00000000')"); n != 2 {
		t.Fatalf("effects of the marker-shaped records = %d, want 2", n)
	}
}

// offsetWatch polls a group's committed offsets and remembers any that
// went backwards.
type offsetWatch struct {
	mu    sync.Mutex
	last  map[int32]int64
	backs []string
}

func (e *env) watchOffsets(t *testing.T, group, topic string) (*offsetWatch, func()) {
	w := &offsetWatch{last: map[int32]int64{}}
	adm := e.k.Admin(t)
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		for {
			select {
			case <-done:
				return
			case <-time.After(10 * time.Millisecond):
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			offs, err := adm.FetchOffsets(ctx, e.group(group))
			cancel()
			if err != nil {
				continue
			}
			w.mu.Lock()
			for p, o := range offs[topic] {
				if o.At < 0 {
					continue
				}
				if prev, ok := w.last[p]; ok && o.At < prev {
					w.backs = append(w.backs, fmt.Sprintf("partition %d: %d after %d", p, o.At, prev))
				}
				w.last[p] = o.At
			}
			w.mu.Unlock()
		}
	}()
	var once sync.Once
	stop := func() { once.Do(func() { close(done); <-stopped }) }
	t.Cleanup(stop)
	return w, stop
}

// testOffsetsNeverGoBack: members join and leave while every partition has
// work queued. A member stops work and commits for partitions it no longer
// owns, so no committed offset ever moves backwards, and every message has
// exactly one effect.
func testOffsetsNeverGoBack(t *testing.T, a Adapter) {
	e := setup(t, a)
	topic := e.k.Topic(t, 4)
	const n = 600
	recs := make([]rec, n)
	for i := range recs {
		recs[i] = rec{id: "id-" + strconv.Itoa(i), key: "k" + strconv.Itoa(i%16), value: strconv.Itoa(i), partition: int32(i % 4)}
	}
	e.produce(t, topic, recs...)
	slow := func(name string) *consumer.Processor {
		p, err := consumer.New(e.pool, name, func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
			time.Sleep(5 * time.Millisecond) // a handler that takes a while, so each partition has a queue
			return record(ctx, tx, e.effects, name, m)
		}, &consumer.Config{Schema: e.schema})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	watch, stopWatch := e.watchOffsets(t, "g", topic)
	stopA := e.start(t, slow("ledger"), "g", topic)
	waitFor(t, 30*time.Second, "A to make progress", func() bool { return e.count(t, "") >= 60 })
	stopB := e.start(t, slow("ledger"), "g", topic)
	waitFor(t, 60*time.Second, "progress with two members", func() bool { return e.count(t, "") >= 250 })
	stopC := e.start(t, slow("ledger"), "g", topic)
	waitFor(t, 60*time.Second, "progress with three members", func() bool { return e.count(t, "") >= 400 })
	stopA()
	e.waitCommitted(t, "g", topic, 90*time.Second)
	stopB()
	stopC()
	stopWatch()
	watch.mu.Lock()
	backs := watch.backs
	watch.mu.Unlock()
	if len(backs) > 0 {
		t.Errorf("committed offsets moved backwards: %v", head(backs))
	}
	e.exactlyOnce(t, "ledger", n)
}
