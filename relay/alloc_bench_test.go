package relay_test

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relayprom"
)

// allocEvents is how many events one drain of BenchmarkRelayAllocs
// publishes: enough that the relay's fixed costs (start, leases, probes)
// weigh little per event, few enough for `make bench`.
const allocEvents = 5000

// BenchmarkRelayAllocs counts heap allocations per published event on the
// relay's whole path (claim, records, publish, judge, delete), draining
// allocEvents events, each with a traceparent header, into a publisher that
// acknowledges everything in memory, so only the relay's (and pgx's)
// allocations are counted. "off" has no Observer: the relay does no
// per-event observer work, so tracing must add nothing there (compare with
// the same benchmark before EventObserver existed). "batch-observer"
// implements Observer only (as relayprom did before the dwell histogram),
// "event-nop" adds a do-nothing EventObserver (the floor of per-event
// observing) and "relayprom" is the binary's observer with tracing off
// (the dwell histogram included). otelonceflow's BenchmarkRelayTracingAllocs
// measures the same path with tracing on.
//
//	go test -run '^$' -bench RelayAllocs -benchtime 5x ./relay/
func BenchmarkRelayAllocs(b *testing.B) {
	for _, tc := range []struct {
		name string
		obs  func() relay.Observer
	}{
		{"off", func() relay.Observer { return nil }},
		{"batch-observer", func() relay.Observer { return batchOnlyObserver{} }},
		{"event-nop", func() relay.Observer { return nopEventObserver{} }},
		{"relayprom", func() relay.Observer { return relayprom.NewObserver(prometheus.NewRegistry()) }},
	} {
		b.Run(tc.name, func(b *testing.B) {
			var allocs uint64
			for range b.N {
				allocs += drainAllocs(b, tc.obs(), allocEvents)
			}
			b.ReportMetric(float64(allocs)/float64(b.N*allocEvents), "allocs/event")
		})
	}
}

// drainAllocs fills a fresh schema with n events (100 keys, 64-byte values,
// a traceparent header each), runs a relay with obs until they are all
// acknowledged and deleted, and returns the heap allocations counted from
// Run's start to its return. The benchmark timer runs only meanwhile.
func drainAllocs(b *testing.B, obs relay.Observer, n int) uint64 {
	b.Helper()
	b.StopTimer()
	ctx := context.Background()
	schema := pgtest.Schema(b)
	pool := pgtest.Pool(b)
	table := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (topic, key, value, headers)
SELECT 'bench', ('key-' || (g % 100))::bytea, convert_to(repeat('x', 64), 'UTF8'),
       jsonb_build_object('traceparent', '00-' || md5(g::text) || '-' || left(md5((-g)::text), 16) || '-01')
FROM generate_series(1, $1) g`, n); err != nil {
		b.Fatal(err)
	}
	pub := &ackPublisher{want: int64(n), all: make(chan struct{})}
	r, err := relay.New(pool, pub, &relay.Config{Schema: schema, Observer: obs, LeaseDuration: 10 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	b.StartTimer()
	go func() { done <- r.Run(runCtx) }()
	select {
	case <-pub.all:
	case <-time.After(2 * time.Minute):
		b.Fatalf("%d of %d events published in 2m", pub.acked.Load(), n)
	}
	cancel() // Run records the last round's outcome before it returns
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	runtime.ReadMemStats(&m1)
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&left); err != nil {
		b.Fatal(err)
	}
	if left != 0 {
		b.Fatalf("%d events left in the outbox after the drain", left)
	}
	pgtest.DropSchema(b, schema)
	b.StartTimer()
	return m1.Mallocs - m0.Mallocs
}

// ackPublisher acknowledges every record at once and closes all once want
// records were acknowledged.
type ackPublisher struct {
	want  int64
	acked atomic.Int64
	all   chan struct{}
}

func (p *ackPublisher) Publish(_ context.Context, records []relay.Record) []error {
	if p.acked.Add(int64(len(records))) == p.want {
		close(p.all)
	}
	return make([]error, len(records))
}

func (p *ackPublisher) Close() error { return nil }

type batchOnlyObserver struct{}

func (batchOnlyObserver) ObserveBatch(relay.BatchStats) {}
func (batchOnlyObserver) ObserveShards(int)             {}

type nopEventObserver struct{ batchOnlyObserver }

func (nopEventObserver) ObservePublished(relay.PublishedEvent) {}
