package relay_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaytest"
)

// keylessAtCap writes keys events of partition 0 of a fresh topic whose
// partition 0 refuses every write (NOT_ENOUGH_REPLICAS), then keyless
// events of the same topic, and starts a relay holding at most 2 keys with
// rounds of batch. It returns the fault (to heal it) and the relay's
// rounds, counted by what it did next.
func keylessAtCap(t *testing.T, b *bundle, keys, keyless, batch int) (*kfake.FaultHandle, *roundCounter) {
	t.Helper()
	fake := b.kafka.RequireFake(t)
	topic := b.kafka.Topic(t, 4)
	h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Partitions: []int32{0}, Err: kerr.NotEnoughReplicas, Count: -1})
	t.Cleanup(h.Remove)
	b.write(t, onPartition0(topic, "sick", keys)...)
	var msgs []outbox.Message
	for range keyless {
		msgs = append(msgs, outbox.Message{Topic: topic, Value: []byte("keyless")})
	}
	b.write(t, msgs...)
	counter := &roundCounter{}
	logger := slog.New(slog.NewTextHandler(counter, &slog.HandlerOptions{Level: slog.LevelDebug}))
	_, stop := b.startRelayWith(t, b.pool, b.publisher(t), relay.Config{BatchSize: batch, MaxHeldKeys: 2, PublishTimeout: time.Second, MaxRetryBackoff: time.Second, Logger: logger})
	t.Cleanup(stop)
	return h, counter
}

// onPartition0 returns n events of topic (of four partitions), each of a key
// of its own ("prefix-i") that the Java partitioner puts on partition 0.
func onPartition0(topic, prefix string, n int) []outbox.Message {
	var msgs []outbox.Message
	for i := 0; len(msgs) < n; i++ {
		if key := fmt.Appendf(nil, "%s-%d", prefix, i); relaytest.JavaPartition(key, 4) == 0 {
			msgs = append(msgs, outbox.Message{Topic: topic, Key: key, Value: []byte(prefix)})
		}
	}
	return msgs
}

// Keyless events of a topic with a sick partition are not sent (the
// partition they would go to is not known); with the held keys at
// Config.MaxHeldKeys they cannot be held back either. They must then wait,
// as a keyed event past a ceiling does, until the held keys are down to
// half: they were left pending and read again, in every round the held
// keys' retries made and, in one run in two, at once round after round
// (about 600 rounds a second), each round charging each an attempt (found
// by a reviewer). So too past the 4,096 events the reads leave out by id
// (a second review): a ceiling for the topic's keyless events then stops
// the rest.
func TestKeylessEventsOfASickTopicAtTheHeldKeysCapDoNotSpin(t *testing.T) {
	if testing.Short() {
		t.Skip("watches relays for 10 s; skipped with -short")
	}
	for _, c := range []struct {
		name                  string
		keyless, batch, after int
	}{
		{"20 keyless events", 20, 20, 6},
		{"more keyless events than the reads leave out by id", 4300, 50, 8},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			_, counter := keylessAtCap(t, b, 3, c.keyless, c.batch)
			time.Sleep(time.Duration(c.after) * time.Second) // the sick keys fail, the cap is reached
			table := pgx.Identifier{b.schema, "outbox"}.Sanitize()
			attempts := func() int {
				var n int
				if err := b.pool.QueryRow(context.Background(), `SELECT coalesce(sum(attempts), 0) FROM `+table+` WHERE key IS NULL`).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			}
			counter.mu.Lock()
			rounds0 := counter.rounds
			counter.mu.Unlock()
			attempts0 := attempts()
			time.Sleep(2 * time.Second)
			attempts1 := attempts()
			counter.mu.Lock()
			defer counter.mu.Unlock()
			t.Logf("%d rounds in 2 s, the keyless events charged %d attempts more", counter.rounds-rounds0, attempts1-attempts0)
			if attempts1 > attempts0 {
				t.Errorf("with the held keys at their cap, the keyless events were read and charged %d attempts more in 2 s (%d rounds)", attempts1-attempts0, counter.rounds-rounds0)
			}
		})
	}
}

// The keyless events left out at the cap are read again once the held
// keys are down to half, with no keyed event's ceiling to lift: when the
// sick partition heals, everything is published.
func TestKeylessEventsLeftOutAtTheCapGoOutOnceItLifts(t *testing.T) {
	if testing.Short() {
		t.Skip("watches a relay for 4 s; skipped with -short")
	}
	t.Parallel()
	b := setup(t)
	heal, _ := keylessAtCap(t, b, 2, 20, 20)
	time.Sleep(4 * time.Second)
	heal.Remove()
	waitFor(t, "every event published", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
}

// A topic's keyless events that wait at the cap go out once the topic has
// no sick partition, though another topic's sick partition keeps the held
// keys at their cap: here topic U's, sick for good, pins the cap; topic T
// is sick long enough for more keyless events than the reads leave out by
// id to wait, then heals. A version that dropped T's keyless events until
// the cap lifted left them, the ones written after T healed, and a third
// topic's events behind them pending (found by a review).
func TestKeylessEventsOfAHealedTopicGoOutWhileAnotherPinsTheCap(t *testing.T) {
	if testing.Short() {
		t.Skip("watches a relay for about 20 s; skipped with -short")
	}
	t.Parallel()
	b := setup(t)
	fake := b.kafka.RequireFake(t)
	u, tt, v := b.kafka.Topic(t, 4), b.kafka.Topic(t, 4), b.kafka.Topic(t, 4)
	hu := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: u, Partitions: []int32{0}, Err: kerr.NotEnoughReplicas, Count: -1})
	t.Cleanup(hu.Remove)
	ht := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: tt, Partitions: []int32{0}, Err: kerr.NotEnoughReplicas, Count: -1})
	t.Cleanup(ht.Remove)
	b.write(t, onPartition0(u, "u", 3)...)
	_, stop := b.startRelayWith(t, b.pool, b.publisher(t), relay.Config{BatchSize: 50, MaxHeldKeys: 2, PublishTimeout: time.Second, MaxRetryBackoff: time.Second})
	t.Cleanup(stop)
	time.Sleep(4 * time.Second) // U's keys: two held, the cap reached
	b.write(t, onPartition0(tt, "t", 1)...)
	time.Sleep(3 * time.Second) // T's partition 0 sick
	var msgs []outbox.Message
	for range 4300 {
		msgs = append(msgs, outbox.Message{Topic: tt, Value: []byte("keyless-before")})
	}
	b.write(t, msgs...)
	time.Sleep(6 * time.Second) // T's keyless events wait, more than by id
	ht.Remove()                 // T heals; U does not
	msgs = msgs[:0]
	for range 10 {
		msgs = append(msgs, outbox.Message{Topic: tt, Value: []byte("keyless-after")})
	}
	for i := range 10 {
		msgs = append(msgs, outbox.Message{Topic: v, Key: fmt.Appendf(nil, "v-%d", i), Value: []byte("v")})
	}
	b.write(t, msgs...)
	table := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	waitFor(t, "T's keyless events and V's events to go out", 30*time.Second, func() bool {
		var n int
		if err := b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+table+` WHERE topic = $1 OR topic = $2`, tt, v).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
}
