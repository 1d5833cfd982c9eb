package relay_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// claimCounter counts the relay's claims (statements reading outbox rows
// with their size: the claim's columns).
type claimCounter struct{ n atomic.Int64 }

func (c *claimCounter) count(sql string) {
	if strings.Contains(sql, "AS size") {
		c.n.Add(1)
	}
}

func (c *claimCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.count(d.SQL)
	return ctx
}
func (c *claimCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *claimCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (c *claimCounter) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	c.count(d.SQL)
}
func (c *claimCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// A relay whose only pending events are a held key's (its first event
// refused as an unknown topic, within the grace; a later event written
// after) has nothing it may publish until the key's retry: it must not read
// its shards on every ProbeInterval (5 ms), only at PollInterval and at the
// key's retries.
func TestRelayWithOnlyAHeldKeysEventsPendingDoesNotReadEveryProbe(t *testing.T) {
	b := setup(t)
	pool, counter := countingPool(t)

	b.write(t, outbox.Message{Topic: "no-such-topic-review", Key: []byte("k"), Value: []byte("1")})
	b.startRelayWith(t, pool, b.publisher(t), relay.Config{
		PollInterval: 2 * time.Second, UnknownTopicGrace: 10 * time.Minute, MaxRetryBackoff: 2 * time.Second,
	})
	waitFor(t, "the first event to fail", 30*time.Second, func() bool {
		var n int
		_ = b.pool.QueryRow(context.Background(), `SELECT coalesce(max(attempts), 0) FROM `+pgx.Identifier{b.schema, "outbox"}.Sanitize()).Scan(&n)
		return n > 0
	})
	// A later event of the held key: the newest id, which the relay may
	// not read while the key is held.
	b.write(t, outbox.Message{Topic: "no-such-topic-review", Key: []byte("k"), Value: []byte("2")})
	time.Sleep(2 * time.Second) // settle (not a condition: we measure a rate)
	before := counter.n.Load()
	const window = 10 * time.Second
	time.Sleep(window)
	claims := counter.n.Load() - before
	// PollInterval 2 s and retries at most every 2 s: about 10 claims in
	// 10 s; allow 60. Every 5 ms would be up to 2,000.
	t.Logf("%d claims in %s", claims, window)
	if claims > 60 {
		t.Fatalf("the relay read its shards %d times in %s with nothing it may publish (PollInterval 2s): it re-reads on every probe", claims, window)
	}
}
