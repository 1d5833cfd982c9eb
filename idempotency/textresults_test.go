package idempotency_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// setupTextSetting is setup with a pool of its own that sends every
// statement in mode on connections that run set when they connect.
func setupTextSetting(t *testing.T, mode pgx.QueryExecMode, set string) bundle {
	t.Helper()
	b := setup(t)
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.DefaultQueryExecMode = mode
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, set)
		return err
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	b.pool = pool
	return b
}

// In exec and simple_protocol mode (PgBouncer in transaction mode) results
// come as text; under a bytea_output or DateStyle pgx cannot read as text,
// the stored response and the Fence's stored result must still be
// replayed, not fail with a scan error.
func TestReplayUnderTextResultSettings(t *testing.T) {
	t.Parallel()
	for _, set := range []string{`SET bytea_output = 'escape'`, `SET DateStyle = 'German'`, `SET DateStyle = 'SQL, DMY'`} {
		for _, qm := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
			t.Run(set+"/"+qm.String(), func(t *testing.T) {
				t.Parallel()
				for _, mode := range modes {
					b := setupTextSetting(t, qm, set)
					var runs atomic.Int64
					srv := newServer(t, b, idempotency.Config{Mode: mode}, orderHandler(b, &runs))
					first := send(t, srv, request{key: "k", body: `{"amount_cents":500}`})
					if first.status != http.StatusCreated || first.replayed {
						t.Fatalf("%s: first: %d %q", mode, first.status, first.body)
					}
					again := send(t, srv, request{key: "k", body: `{"amount_cents":500}`})
					if !again.replayed || again.body != first.body || runs.Load() != 1 {
						t.Fatalf("%s: retry: %d %q replayed=%v, runs %d; want the stored response", mode, again.status, again.body, again.replayed, runs.Load())
					}
				}
				b := setupTextSetting(t, qm, set)
				f := newFence(t, b, idempotency.FenceConfig{Lease: time.Second})
				result := []byte{0, 'r', 0xff, '\\', 'x'}
				for i := range 2 {
					got, err := f.Do(context.Background(), "k", func(context.Context) ([]byte, error) { return result, nil })
					if err != nil || string(got) != string(result) {
						t.Fatalf("Fence.Do #%d: %q, %v; want %q", i+1, got, err, result)
					}
				}
			})
		}
	}
}
