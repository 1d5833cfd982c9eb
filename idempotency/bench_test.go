package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// countingTracer counts statements sent to PostgreSQL, BEGIN and COMMIT
// included: each is one round trip (the package sends no pipelines).
type countingTracer struct{ n atomic.Int64 }

func (c *countingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *countingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// BenchmarkMiddleware measures a trivial handler served in-process (no
// network between client and server) with and without the middleware, on
// the first-request path (a new key each time) and the replay path (one
// stored key). It reports requests/s and database round trips per request.
func BenchmarkMiddleware(b *testing.B) {
	schema := pgtest.Schema(b)
	cfg, err := pgxpool.ParseConfig(pgtest.URL(b))
	if err != nil {
		b.Fatal(err)
	}
	tracer := &countingTracer{}
	cfg.ConnConfig.Tracer = tracer
	cfg.MaxConns = 16
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	trivial := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"order_id":"o-1"}`))
	})
	run := func(b *testing.B, h http.Handler, key func(i int64) string) {
		var seq atomic.Int64
		tracer.n.Store(0)
		b.SetParallelism(8)
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				req := httptest.NewRequest(http.MethodPost, "/orders", nil)
				if k := key(seq.Add(1)); k != "" {
					req.Header.Set(idempotency.KeyHeader, k)
				}
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, req)
				if rec.Code != http.StatusCreated {
					b.Errorf("status %d: %s", rec.Code, rec.Body)
				}
			}
		})
		b.StopTimer()
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
		b.ReportMetric(float64(tracer.n.Load())/float64(b.N), "roundtrips/req")
	}
	b.Run("bare", func(b *testing.B) { run(b, trivial, func(int64) string { return "" }) })
	// The machine's ceiling for one round trip per request, same pool and
	// parallelism: the replay path cannot beat it.
	b.Run("ceiling/select1", func(b *testing.B) {
		run(b, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			var one int
			if err := pool.QueryRow(r.Context(), `SELECT 1`).Scan(&one); err != nil {
				b.Error(err)
			}
			trivial(w, r)
		}), func(int64) string { return "" })
	})
	for _, mode := range []idempotency.Mode{idempotency.Transactional, idempotency.Leased} {
		mw, err := idempotency.New(pool, &idempotency.Config{Schema: schema, Mode: mode, Scope: idempotency.SharedScope})
		if err != nil {
			b.Fatal(err)
		}
		h := mw.Handler(trivial)
		prefix := mode.String() + "-" + strconv.Itoa(int(mode))
		var round atomic.Int64
		b.Run(mode.String()+"/first", func(b *testing.B) {
			r := round.Add(1)
			run(b, h, func(i int64) string { return prefix + "-" + strconv.FormatInt(r, 10) + "-" + strconv.FormatInt(i, 10) })
		})
		replayKey := prefix + "-replay"
		req := httptest.NewRequest(http.MethodPost, "/orders", nil)
		req.Header.Set(idempotency.KeyHeader, replayKey)
		h.ServeHTTP(httptest.NewRecorder(), req)
		b.Run(mode.String()+"/replay", func(b *testing.B) { run(b, h, func(int64) string { return replayKey }) })
	}
}
