package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// countingPool is a pool whose claims claimCounter counts.
func countingPool(t *testing.T) (*pgxpool.Pool, *claimCounter) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	counter := &claimCounter{}
	cfg.ConnConfig.Tracer = counter
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, counter
}

// claimsIn returns how many claims the relay made in window, after a
// settling second.
func claimsIn(counter *claimCounter, window time.Duration) int64 {
	time.Sleep(time.Second)
	before := counter.n.Load()
	time.Sleep(window)
	return counter.n.Load() - before
}

// The newest id handed out is never visible (its transaction stays open,
// or was rolled back): the probe must not make the relay read its shards
// on every ProbeInterval (5 ms) for it, only at PollInterval. Then a
// commit of it still wakes the relay.
func TestRelayDoesNotReadEveryProbeForANewestIDNeverCommitted(t *testing.T) {
	for _, end := range []string{"open", "rolled back"} {
		t.Run(end, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			topic := b.kafka.Topic(t, 1)
			pool, counter := countingPool(t)
			b.write(t, outbox.Message{Topic: topic, Value: []byte("first")})
			b.startRelayOn(t, pool, relay.Config{PollInterval: 2 * time.Second})
			if got := b.kafka.ReadAll(t, topic, 1, 20*time.Second); len(got) != 1 {
				t.Fatal("first event not published")
			}
			tx := b.writeOpen(t, outbox.Message{Topic: topic, Value: []byte("newest")})
			if end == "rolled back" {
				if err := tx.Rollback(context.Background()); err != nil {
					t.Fatal(err)
				}
			}
			const window = 6 * time.Second
			claims := claimsIn(counter, window)
			t.Logf("%d claims in %s", claims, window)
			if claims > 30 { // PollInterval 2 s: about 3; every probe: up to 1,200
				t.Fatalf("the relay read its shards %d times in %s for a newest id never visible (PollInterval 2s)", claims, window)
			}
			if end == "open" {
				start := time.Now()
				if err := tx.Commit(context.Background()); err != nil {
					t.Fatal(err)
				}
				if got := b.kafka.ReadAll(t, topic, 2, 20*time.Second); len(got) != 2 {
					t.Fatal("the late commit was not published")
				}
				t.Logf("published %s after its commit", time.Since(start).Round(time.Millisecond))
			}
		})
	}
}
