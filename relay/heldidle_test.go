package relay_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
)

// failKeyPub acknowledges every record but those of one key, which fail
// with a passing error (a partition below min.insync.replicas).
type failKeyPub struct{ key string }

func (p *failKeyPub) Publish(_ context.Context, records []relay.Record) []error {
	time.Sleep(time.Millisecond) // the broker's round trip
	errs := make([]error, len(records))
	for i, r := range records {
		if string(r.Key) == p.key {
			errs[i] = errors.New("NOT_ENOUGH_REPLICAS (injected)")
		}
	}
	return errs
}

func (p *failKeyPub) Close() error { return nil }

// roundCounter counts the relay's debug lines for its rounds by what it
// did next.
type roundCounter struct {
	mu                   sync.Mutex
	rounds, idle, atOnce int
}

func (c *roundCounter) Write(p []byte) (int, error) {
	s := string(p)
	if strings.Contains(s, `msg="relay: round"`) {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.rounds++
		switch {
		case strings.Contains(s, "next=idle"):
			c.idle++
		case strings.Contains(s, "next=at_once"):
			c.atOnce++
		}
	}
	return len(p), nil
}

// A key stuck behind a passing error that still gets events (one in 5,000
// of a backlog, over the floor's base as the drain goes on) must not make
// the drain wait for the probe between rounds: a round from which the
// claim dropped a held key's events (a held read, or the merge beside the
// blocked shard) read a whole round all the same, and the relay reads ahead
// and goes on at once. A version that took every round short of BatchSize
// for the end of the backlog waited idle after 85-93 of its ~100 rounds
// (three times the drain's time).
func TestAStuckKeyWithNewEventsDoesNotIdleTheDrain(t *testing.T) {
	if testing.Short() {
		t.Skip("drains 100,000 events; skipped with -short")
	}
	t.Parallel()
	const n, every = 100_000, 5000
	ctx := context.Background()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	table := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (topic, key, value) VALUES ('t', 'stuck', 'x')`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (topic, key, value)
SELECT 't', CASE WHEN g % $2 = 0 THEN 'stuck' ELSE 'k' || (g % 500) END::bytea, convert_to(repeat('x', 100), 'UTF8')
FROM generate_series(1, $1) g`, n, every); err != nil {
		t.Fatal(err)
	}
	others := n - n/every
	drained := &drainObserver{want: int64(others), done: make(chan struct{})}
	counter := &roundCounter{}
	logger := slog.New(slog.NewTextHandler(counter, &slog.HandlerOptions{Level: slog.LevelDebug}))
	r, err := relay.New(pool, &failKeyPub{key: "stuck"}, &relay.Config{Schema: schema, Observer: drained, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	select {
	case <-drained.done:
	case <-time.After(2 * time.Minute):
		t.Fatal("the other keys did not drain in 2 minutes")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	counter.mu.Lock()
	defer counter.mu.Unlock()
	t.Logf("%d other events: %d rounds, %d went on at once, %d waited idle", others, counter.rounds, counter.atOnce, counter.idle)
	if counter.idle > counter.rounds/10 {
		t.Errorf("%d of %d rounds of the drain waited idle for the probe with the backlog pending", counter.idle, counter.rounds)
	}
}
