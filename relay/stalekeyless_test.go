package relay_test

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// failingPublisher fails the records whose value is in fail while on,
// and the later records of a key after one failed in the call (as one
// partition does); it records first publications.
type failingPublisher struct {
	mu    sync.Mutex
	on    bool
	fail  map[string]bool
	acked *[]string
	amu   *sync.Mutex
}

func (p *failingPublisher) Publish(_ context.Context, records []relay.Record) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	errs := make([]error, len(records))
	failed := map[string]bool{}
	for i, r := range records {
		if r.Key != nil && failed[string(r.Key)] {
			errs[i] = errors.New("held: earlier failed")
			continue
		}
		if p.on && p.fail[string(r.Value)] {
			errs[i] = errors.New("not enough replicas")
			if r.Key != nil {
				failed[string(r.Key)] = true
			}
			continue
		}
		p.amu.Lock()
		*p.acked = append(*p.acked, string(r.Value))
		p.amu.Unlock()
	}
	return errs
}

func (p *failingPublisher) Close() error { return nil }

func (p *failingPublisher) heal() {
	p.mu.Lock()
	p.on = false
	p.mu.Unlock()
}

// keylessIDInShards returns an event id whose shard (the first byte of the
// sha256 of its 16 bytes) is at least from.
func keylessIDInShards(from byte) string {
	for {
		var u [16]byte
		_, _ = rand.Read(u[:])
		u[6] = u[6]&0x0f | 0x40
		u[8] = u[8]&0x3f | 0x80
		if sha256.Sum256(u[:])[0] >= from {
			return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:])
		}
	}
}

// Two keyless events fail on relay A, which holds them back (the held keys
// are then at Config.MaxHeldKeys = 2), and a keyed event fails after them:
// A raises a ceiling over it. Relay B joins; the keyless events' shards
// (128 and up) move to B, which publishes them. A's holds on them are stale
// now, and nothing ever forgets them: forgetLostRetries skips keyless holds,
// the side retry is not theirs, and forgetStaleBlocks runs only at the end
// of a round that sent something, which A, whose every event is above its
// ceiling, never has. The held keys stay above half their cap, so the
// ceiling never lifts, and the key's events (on A's shards) are never
// published (G2), even with Kafka healthy again.
func TestKeylessHoldsLostToAShardMoveLetTheCeilingLift(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	var acked []string
	var amu sync.Mutex
	x1, x2 := keylessIDInShards(128), keylessIDInShards(128)
	key := ""
	for i := 0; key == ""; i++ {
		if k := fmt.Sprint("key", i); sha256.Sum256([]byte(k))[0] < 128 {
			key = k
		}
	}
	outboxT := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	for _, s := range []struct{ id, v string }{{x1, "x1"}, {x2, "x2"}} {
		if _, err := b.pool.Exec(ctx, `INSERT INTO `+outboxT+` (topic, event_id, value) VALUES ('t', $1::uuid, $2::bytea)`, s.id, []byte(s.v)); err != nil {
			t.Fatal(err)
		}
	}
	b.write(t, outbox.Message{Topic: "t", Key: []byte(key), Value: []byte("k1")}, outbox.Message{Topic: "t", Key: []byte(key), Value: []byte("k2")})

	pubA := &failingPublisher{on: true, fail: map[string]bool{"x1": true, "x2": true, "k1": true}, acked: &acked, amu: &amu}
	cfg := relay.Config{BatchSize: 10, MaxHeldKeys: 2, MaxRetryBackoff: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond, LeaseDuration: time.Second}
	cfgA := cfg
	cfgA.InstanceID = "A"
	b.startRelayWith(t, b.pool, pubA, cfgA)
	attempts := func(v string) (n int) {
		_ = b.pool.QueryRow(ctx, `SELECT coalesce(max(attempts), -1) FROM `+outboxT+` WHERE value = $1::bytea`, []byte(v)).Scan(&n)
		return n
	}
	waitFor(t, "A to retry the keyless events", 10*time.Second, func() bool { return attempts("x1") >= 3 && attempts("x2") >= 3 })

	pubB := &failingPublisher{fail: map[string]bool{}, acked: &acked, amu: &amu}
	cfgB := cfg
	cfgB.InstanceID = "B"
	b.startRelayWith(t, b.pool, pubB, cfgB)
	waitFor(t, "B to publish the keyless events", 15*time.Second, func() bool { return attempts("x1") < 0 && attempts("x2") < 0 })
	pubA.heal()

	// Kafka is healthy; the key's events are on A's shards. Past
	// forgetStaleBlocks' minute too.
	deadline := time.Now().Add(75 * time.Second)
	for b.count(t, "outbox") > 0 {
		if time.Now().After(deadline) {
			amu.Lock()
			defer amu.Unlock()
			t.Fatalf("the key's events still pending 75s after Kafka healed (G2); published: %v", acked)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
