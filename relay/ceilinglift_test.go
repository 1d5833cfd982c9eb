package relay_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// liftPublisher puts key "s2" on partition 0, "s1" on partition 2 and the
// others on partition 1. It fails "s1" while failS1 is set and the event
// "s2a" once, both with relay.ErrUnknownTopic (a held key, not a sick
// partition), and records the values it acknowledges, in order. Once
// failS1 is unset, it acknowledges "s1" only in a whole round (BatchSize 2):
// a round that reads ahead.
type liftPublisher struct {
	mu        sync.Mutex
	failS1    bool
	s2aFailed bool
	acked     []string
	h         int // acknowledged events of other keys
}

func (p *liftPublisher) Partition(_ string, key []byte) (int32, bool) {
	switch string(key) {
	case "s2":
		return 0, true
	case "s1":
		return 2, true
	}
	return 1, true
}

func (p *liftPublisher) Publish(_ context.Context, records []relay.Record) []error {
	time.Sleep(time.Millisecond) // a round takes a little while
	p.mu.Lock()
	defer p.mu.Unlock()
	errs := make([]error, len(records))
	for i, r := range records {
		switch {
		case string(r.Key) == "s1" && (p.failS1 || len(records) < 2):
			errs[i] = relay.ErrUnknownTopic
		case string(r.Value) == "s2a" && !p.s2aFailed:
			p.s2aFailed = true
			errs[i] = relay.ErrUnknownTopic
		default:
			if string(r.Key) == "s2" {
				p.acked = append(p.acked, string(r.Value))
			} else if string(r.Key) != "s1" {
				p.h++
			}
		}
	}
	return errs
}

func (p *liftPublisher) Close() error { return nil }

// Under a Config.MaxHeldKeys ceiling, key s2's failed event s2a is left out
// of the reads by id; a read-ahead made then reads s2's later events past
// it. When the ceiling lifts before that read-ahead's round, its s2 events
// must not go out before s2a (G3).
func TestRelayCeilingLiftDoesNotPublishAReadAheadPastASkippedEvent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pub := &liftPublisher{failS1: true}
	b.write(t,
		outbox.Message{Topic: "t", Key: []byte("s1"), Value: []byte("s1")},
		outbox.Message{Topic: "t", Key: []byte("s2"), Value: []byte("s2a")},
	)
	b.startRelayWith(t, b.pool, pub, relay.Config{BatchSize: 2, MaxHeldKeys: 1, MaxRetryBackoff: 300 * time.Millisecond})
	outboxTable := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	waitFor(t, "both events to fail", 30*time.Second, func() bool {
		var n int
		_ = b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+outboxTable+` WHERE attempts > 0`).Scan(&n)
		return n == 2
	})
	var msgs []outbox.Message
	want := []string{"s2a"}
	for i := range 1000 {
		v := fmt.Sprintf("s2b%03d", i)
		want = append(want, v)
		msgs = append(msgs,
			outbox.Message{Topic: "t", Key: []byte("h"), Value: []byte("h")},
			outbox.Message{Topic: "t", Key: []byte("s2"), Value: []byte(v)})
	}
	b.write(t, msgs...)
	// s1's retry succeeds in a whole round (which reads ahead past s2's
	// events left out), and the ceiling lifts, while the other events are
	// being published beside the ceiling.
	waitFor(t, "other events published", 30*time.Second, func() bool {
		pub.mu.Lock()
		defer pub.mu.Unlock()
		return pub.h >= 100
	})
	pub.mu.Lock()
	pub.failS1 = false
	pub.mu.Unlock()
	waitFor(t, "the outbox drained", 60*time.Second, func() bool {
		var n int
		_ = b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+outboxTable).Scan(&n)
		return n == 0
	})
	pub.mu.Lock()
	defer pub.mu.Unlock()
	seen := map[string]bool{}
	var first []string
	for _, v := range pub.acked {
		if !seen[v] {
			seen[v] = true
			first = append(first, v)
		}
	}
	for i := range want {
		if i >= len(first) || first[i] != want[i] {
			got := first[:min(len(first), i+3)]
			t.Fatalf("key s2's events first published out of order at %d: got %v..., want %v...", i, got, want[:min(len(want), i+3)])
		}
	}
}
