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

// Keyless events of a topic with a sick partition are not sent (the
// partition they would go to is not known); with the held keys at
// Config.MaxHeldKeys they cannot be held back either. They must then wait,
// as a keyed event past a ceiling does, until the held keys are down to
// half: they were left pending and read again, in every round the held
// keys' retries made and, in one run in two, at once round after round
// (about 600 rounds a second), each round charging each an attempt (found
// by a reviewer).
func TestKeylessEventsOfASickTopicAtTheHeldKeysCapDoNotSpin(t *testing.T) {
	if testing.Short() {
		t.Skip("watches a relay for 5 s; skipped with -short")
	}
	t.Parallel()
	b := setup(t)
	fake := b.kafka.RequireFake(t)
	topic := b.kafka.Topic(t, 4)
	h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Partitions: []int32{0}, Err: kerr.NotEnoughReplicas, Count: -1})
	defer h.Remove()
	var msgs []outbox.Message
	for i := 0; len(msgs) < 10; i++ {
		key := fmt.Appendf(nil, "sick-%d", i)
		if relaytest.JavaPartition(key, 4) == 0 {
			msgs = append(msgs, outbox.Message{Topic: topic, Key: key, Value: []byte("sick")})
		}
	}
	b.write(t, msgs...)
	msgs = msgs[:0]
	for range 20 {
		msgs = append(msgs, outbox.Message{Topic: topic, Value: []byte("keyless")})
	}
	b.write(t, msgs...)
	counter := &roundCounter{}
	logger := slog.New(slog.NewTextHandler(counter, &slog.HandlerOptions{Level: slog.LevelDebug}))
	_, stop := b.startRelayWith(t, b.pool, b.publisher(t), relay.Config{BatchSize: 20, MaxHeldKeys: 2, PublishTimeout: time.Second, Logger: logger})
	defer stop()
	time.Sleep(6 * time.Second) // the sick keys fail, the cap is reached
	counter.mu.Lock()
	rounds0 := counter.rounds
	counter.mu.Unlock()
	var attempts0 int
	table := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	if err := b.pool.QueryRow(context.Background(), `SELECT coalesce(sum(attempts), 0) FROM `+table+` WHERE key IS NULL`).Scan(&attempts0); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	var attempts1 int
	if err := b.pool.QueryRow(context.Background(), `SELECT coalesce(sum(attempts), 0) FROM `+table+` WHERE key IS NULL`).Scan(&attempts1); err != nil {
		t.Fatal(err)
	}
	counter.mu.Lock()
	defer counter.mu.Unlock()
	t.Logf("%d rounds in 2 s, the keyless events charged %d attempts more", counter.rounds-rounds0, attempts1-attempts0)
	if attempts1 > attempts0 {
		t.Errorf("with the held keys at their cap, the keyless events were read and charged %d attempts more in 2 s (%d rounds)", attempts1-attempts0, counter.rounds-rounds0)
	}
}
