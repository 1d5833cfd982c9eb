package otelonceflow_test

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/otelonceflow"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relayprom"
)

// BenchmarkRelayTracingAllocs is relay's BenchmarkRelayAllocs (the same
// drain of 5,000 events carrying a traceparent header into a publisher that
// acknowledges in memory) as `onceflow relay` runs it: "off" is the binary
// with no OTEL_* variables (relayprom's observer, dwell histogram
// included), "on" wraps it in a RelayObserver with a sampling SDK tracer
// provider (a span per event, recorded and dropped: no exporter).
//
//	go test -run '^$' -bench RelayTracingAllocs -benchtime 5x ./otelonceflow/
func BenchmarkRelayTracingAllocs(b *testing.B) {
	const events = 5000
	for _, tc := range []struct {
		name string
		obs  func(*sdktrace.TracerProvider) relay.Observer
	}{
		{"off", func(*sdktrace.TracerProvider) relay.Observer { return relayprom.NewObserver(prometheus.NewRegistry()) }},
		{"on", func(tp *sdktrace.TracerProvider) relay.Observer {
			return otelonceflow.NewRelayObserver(relayprom.NewObserver(prometheus.NewRegistry()), otelonceflow.WithTracerProvider(tp))
		}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			tp := sdktrace.NewTracerProvider()
			defer func() { _ = tp.Shutdown(context.Background()) }()
			var allocs uint64
			for range b.N {
				allocs += drainAllocs(b, tc.obs(tp), events)
			}
			b.ReportMetric(float64(allocs)/float64(b.N*events), "allocs/event")
		})
	}
}

// drainAllocs fills a fresh schema with n events (100 keys, 64-byte values,
// a traceparent header each), runs a relay with obs until they are all
// acknowledged and deleted, and returns the heap allocations counted from
// Run's start to its return (relay/alloc_bench_test.go's harness).
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
