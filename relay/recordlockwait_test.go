package relay_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// lockWaitTracer notes the lock_timeout a round's record sets.
type lockWaitTracer struct {
	mu   sync.Mutex
	seen []string
}

func (*lockWaitTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (*lockWaitTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (l *lockWaitTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	if d.Batch == nil {
		return ctx
	}
	for _, q := range d.Batch.QueuedQueries {
		if strings.Contains(q.SQL, "set_config('lock_timeout', $1, true)") && len(q.Arguments) == 1 {
			if s, ok := q.Arguments[0].(string); ok {
				l.mu.Lock()
				l.seen = append(l.seen, s)
				l.mu.Unlock()
			}
		}
	}
	return ctx
}
func (*lockWaitTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (*lockWaitTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

func (l *lockWaitTracer) values() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.seen...)
}

// New reads Config.LeaseDuration for the record's lock wait from the
// caller's *Config, not the defaulted one: with LeaseDuration left at its
// default (6 s) the record's lock_timeout is "0", no bound at all (a
// frozen relay's record holds its dead letters' shards, FOR KEY SHARE,
// for as long as an operator's lock lasts), where five leases (30 s) is
// documented.
func TestARecordsLockWaitIsFiveLeasesAtTheDefaultLease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.write(t, outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("v")})
	var tr lockWaitTracer
	r, err := relay.New(pgtest.TracedPool(t, &tr, 4), b.publisher(t), &relay.Config{Schema: b.schema, InstanceID: "r", PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitFor(t, "the round's record", 30*time.Second, func() bool { return len(tr.values()) > 0 })
	if got := tr.values()[0]; got != "30000" {
		t.Fatalf("the record's lock_timeout at the default 6 s lease is %q ms, want 30000 (five leases)", got)
	}
}

// cfg may be nil (New's doc), but New dereferences it for the record's
// lock wait.
func TestNewAcceptsANilConfig(t *testing.T) {
	t.Parallel()
	b := setup(t)
	defer func() {
		if p := recover(); p != nil {
			t.Fatalf("relay.New with a nil *Config panicked: %v", p)
		}
	}()
	if _, err := relay.New(b.pool, b.publisher(t), nil); err != nil {
		t.Fatal(err)
	}
}
