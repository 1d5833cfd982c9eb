package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
)

// A relay stopped while its round's outcome cannot be recorded (a
// migration, VACUUM FULL or CLUSTER holds the outbox's ACCESS EXCLUSIVE
// lock) gives up on the record within the stop's grace, as it does on the
// acknowledgements: it waited the record's own 30 s, and an orchestrator's
// grace sized from the docs (Kubernetes' default is 30 s) killed it. The
// round's events stay pending and are published again once the lock goes
// (duplicates, not loss).
func TestAStopUnderAnOutboxLockEndsWithinTheGrace(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	topic := b.kafka.Topic(t, 2)
	msgs := b.writeOverFiveKeys(t, topic, 20)
	pub := gate(b.publisher(t))
	_, stop := b.startRelayWith(t, b.pool, pub, relay.Config{})
	select {
	case <-pub.inFlight:
	case <-time.After(30 * time.Second):
		t.Fatal("the relay published nothing")
	}
	locker := pgtest.Conn(t)
	tx, err := locker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `LOCK TABLE `+pgx.Identifier{b.schema, "outbox"}.Sanitize()+` IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	close(pub.release) // Kafka acknowledges; the record waits for the lock
	time.Sleep(300 * time.Millisecond)
	start := time.Now()
	stop()
	// stopGrace (5 s) for the record, 5 s at most for handing back the
	// shards, which the lock does not hold up.
	if took := time.Since(start); took > 12*time.Second {
		t.Errorf("the relay took %s to stop under the outbox lock, want the stop's grace", took.Round(time.Millisecond))
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := b.count(t, "outbox"); n != len(msgs) {
		t.Fatalf("%d events pending after the abandoned record, want all %d (published again by the next relay)", n, len(msgs))
	}
	_, stop2 := b.startRelay(t, relay.Config{})
	defer stop2()
	waitFor(t, "the next relay to publish the events again", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	seen := map[string]int{}
	for _, r := range b.kafka.ReadAll(t, topic, 2*len(msgs), 30*time.Second) {
		seen[messageID(r)]++
	}
	if len(seen) != len(msgs) {
		t.Fatalf("%d distinct events in Kafka, want %d", len(seen), len(msgs))
	}
}
