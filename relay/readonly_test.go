package relay_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// After a failover the relay's pool may reconnect to a read-only server (a
// standby, or a primary demoted while DNS lags). Its lease upkeep fails
// and its shards lapse, as when the database is away; the warning said
// "until the database answers", though it answers, read-only (helper 70).
// It names the read-only database now, and the relay takes its shards back
// and publishes what was written meanwhile once writes are accepted again.
func TestARelayOnAReadOnlyDatabaseSaysSo(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 2)
	var readOnly atomic.Bool
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		if readOnly.Load() {
			_, err := c.Exec(ctx, `SET default_transaction_read_only = on`)
			return err
		}
		return nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	obs := &shardsObserver{}
	log, logs := newLogger(slog.LevelInfo)
	b.startRelayOn(t, pool, relay.Config{Observer: obs, LeaseDuration: 900 * time.Millisecond, Logger: log})
	waitFor(t, "the relay to own every shard", 30*time.Second, func() bool { return obs.owned.Load() == relay.NumShards })

	readOnly.Store(true)
	pool.Reset() // the failover: every session reconnects, read-only
	waitFor(t, "owned shards to drop to 0 on the read-only database", 30*time.Second, func() bool { return obs.owned.Load() == 0 })
	if len(logs.lines(`level=WARN msg="relay: shard leases lapsed; publishing paused while the database is read-only \(a standby after a failover\?\)" instance=\S+ shards=256`)) == 0 {
		t.Errorf("the read-only lapse was not named:\n%s", logs.String())
	}

	msgs := make([]outbox.Message, 100)
	for i := range msgs {
		msgs[i] = outbox.Message{Topic: topic, Key: fmt.Appendf(nil, "k%d", i%10), Value: fmt.Appendf(nil, "v%d", i)}
	}
	b.write(t, msgs...) // on the writable primary, through the test's own pool
	readOnly.Store(false)
	pool.Reset()
	waitFor(t, "the events written meanwhile to be published", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	if got := b.kafka.ReadAll(t, topic, len(msgs), 30*time.Second); len(got) < len(msgs) {
		t.Fatalf("read %d records back, want %d", len(got), len(msgs))
	}
	checkVocabulary(t, logs)
}
