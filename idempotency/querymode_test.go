package idempotency_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// queryExecModes are every way pgx can send a statement. exec and
// simple_protocol are what PgBouncer in transaction mode needs: no prepared
// statements, parameter types not described by the server.
var queryExecModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement,
	pgx.QueryExecModeCacheDescribe,
	pgx.QueryExecModeDescribeExec,
	pgx.QueryExecModeExec,
	pgx.QueryExecModeSimpleProtocol,
}

// setupQueryMode is setup with a pool of its own that sends every statement
// in mode.
func setupQueryMode(t *testing.T, mode pgx.QueryExecMode) bundle {
	t.Helper()
	b := setup(t)
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.DefaultQueryExecMode = mode
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	b.pool = pool
	return b
}

func TestMiddlewareWorksInEveryQueryExecMode(t *testing.T) {
	t.Parallel()
	for _, qm := range queryExecModes {
		for _, mode := range modes {
			t.Run(qm.String()+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				b := setupQueryMode(t, qm)
				var runs, failRuns atomic.Int64
				srv := newServer(t, b, idempotency.Config{Mode: mode, MaxResponseBytes: 64},
					func(w http.ResponseWriter, r *http.Request) {
						switch r.URL.Path {
						case "/big":
							_, _ = w.Write([]byte(strings.Repeat("x", 100)))
						case "/fail":
							if failRuns.Add(1) == 1 {
								http.Error(w, "boom", http.StatusInternalServerError)
								return
							}
							w.WriteHeader(http.StatusCreated)
						default:
							orderHandler(b, &runs)(w, r)
						}
					})
				first := send(t, srv, request{key: "k", body: `{"amount_cents":500}`})
				if first.status != http.StatusCreated || first.replayed {
					t.Fatalf("first: %d %q", first.status, first.body)
				}
				again := send(t, srv, request{key: "k", body: `{"amount_cents":500}`})
				if !again.replayed || again.body != first.body || again.header.Get("Location") != "/orders/o-1" {
					t.Fatalf("retry: %+v, want the stored response with its headers", again)
				}
				if r := send(t, srv, request{key: "k", body: `{"amount_cents":1}`}); r.status != http.StatusUnprocessableEntity {
					t.Fatalf("other body: %d %q, want 422", r.status, r.body)
				}
				if r := send(t, srv, request{key: "big", path: "/big"}); r.status != http.StatusOK || len(r.body) != 100 {
					t.Fatalf("oversized: %d, %d bytes", r.status, len(r.body))
				}
				if r := send(t, srv, request{key: "big", path: "/big"}); r.status != http.StatusUnprocessableEntity {
					t.Fatalf("oversized retry: %d %q, want 422", r.status, r.body)
				}
				if r := send(t, srv, request{key: "fail", path: "/fail"}); r.status != http.StatusInternalServerError {
					t.Fatalf("failing: %d %q, want 500", r.status, r.body)
				}
				if r := send(t, srv, request{key: "fail", path: "/fail"}); r.status != http.StatusCreated || r.replayed {
					t.Fatalf("retry of a 500: %d %q, want a fresh 201", r.status, r.body)
				}
			})
		}
	}
}

func TestFenceAndPurgerWorkInEveryQueryExecMode(t *testing.T) {
	t.Parallel()
	for _, qm := range queryExecModes {
		t.Run(qm.String(), func(t *testing.T) {
			t.Parallel()
			b := setupQueryMode(t, qm)
			ctx := context.Background()
			f := newFence(t, b, idempotency.FenceConfig{Lease: 3 * time.Second, MaxResultBytes: 8})
			table := pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()

			var renewed bool
			got, err := f.Do(ctx, "k", func(ctx context.Context) ([]byte, error) {
				var first time.Time
				if err := b.pool.QueryRow(ctx, `SELECT lease_until FROM `+table+` WHERE key = 'k'`).Scan(&first); err != nil {
					return nil, err
				}
				deadline := time.Now().Add(20 * time.Second)
				for !renewed && time.Now().Before(deadline) {
					var now time.Time
					if err := b.pool.QueryRow(ctx, `SELECT lease_until FROM `+table+` WHERE key = 'k'`).Scan(&now); err != nil {
						return nil, err
					}
					renewed = now.After(first)
					time.Sleep(10 * time.Millisecond)
				}
				return []byte("receipt"), nil
			})
			if err != nil || string(got) != "receipt" || !renewed {
				t.Fatalf("Do: %q, %v, lease renewed %v", got, err, renewed)
			}
			if got, err := f.Do(ctx, "k", nil); err != nil || string(got) != "receipt" {
				t.Fatalf("replay: %q, %v", got, err)
			}
			boom := errors.New("boom")
			if _, err := f.Do(ctx, "e", func(context.Context) ([]byte, error) { return nil, boom }); !errors.Is(err, boom) {
				t.Fatalf("failing Do: %v", err)
			}
			if _, err := f.Do(ctx, "big", func(context.Context) ([]byte, error) { return []byte("too large"), nil }); err != nil {
				t.Fatal(err)
			}
			if _, err := f.Do(ctx, "big", nil); !errors.Is(err, idempotency.ErrNotStored) {
				t.Fatalf("oversized replay: %v", err)
			}
			// A dead caller's claim, and an expired record, are taken over.
			if _, err := pgtest.Pool(t).Exec(ctx, `INSERT INTO `+table+` (scope, key, fingerprint, state, token, lease_until, expires_at)
VALUES ('do:default', 'dead', '', 'running', gen_random_uuid(), now() - interval '1 second', now() + interval '1 hour'),
       ('do:default', 'old', '', 'done', gen_random_uuid(), NULL, now() - interval '1 second')`); err != nil {
				t.Fatal(err)
			}
			for _, key := range []string{"dead", "old"} {
				if got, err := f.Do(ctx, key, func(context.Context) ([]byte, error) { return []byte("new"), nil }); err != nil || string(got) != "new" {
					t.Fatalf("take over %s: %q, %v", key, got, err)
				}
			}
			if _, err := pgtest.Pool(t).Exec(ctx, `UPDATE `+table+` SET expires_at = now() - interval '1 second'`); err != nil {
				t.Fatal(err)
			}
			p, err := idempotency.NewPurger(b.pool, &idempotency.PurgeConfig{Schema: b.schema, BatchSize: 2})
			if err != nil {
				t.Fatal(err)
			}
			if n, err := p.Purge(ctx); err != nil || n != 4 {
				t.Fatalf("Purge = %d, %v; want 4", n, err)
			}
		})
	}
}
