package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// Payment services often default their sessions to REPEATABLE READ or
// SERIALIZABLE. There, a claim racing another one for the same key reads
// a snapshot that misses the winner's row, and PostgreSQL refuses the
// INSERT ... ON CONFLICT (or the takeover) with a serialization failure
// (40001) where READ COMMITTED would do nothing and read the row: callers
// got that error (Do) or a 500 (the middleware) instead of "in progress"
// or the stored result (helper 112).

// isolatedPool is a pool whose sessions default to isolation level.
func isolatedPool(t *testing.T, level string) *pgxpool.Pool {
	t.Helper()
	return pgtest.PoolWith(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = level
		cfg.MaxConns = 24
	})
}

var strictLevels = []string{"repeatable read", "serializable"}

// raceKeys runs callers at once on each of keys keys through call, and
// fails the test on a key run other than once or an answer other than
// accepted says.
func raceKeys(t *testing.T, keys, callers int, call func(key string, runs *atomic.Int64) error) {
	t.Helper()
	var failed atomic.Int64
	var firstErr atomic.Value
	for k := range keys {
		var runs atomic.Int64
		start := make(chan struct{})
		var wg sync.WaitGroup
		for range callers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				if err := call(fmt.Sprint("key-", k), &runs); err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err)
				}
			}()
		}
		close(start)
		wg.Wait()
		if runs.Load() != 1 {
			t.Errorf("key %d ran %d times, want 1", k, runs.Load())
		}
	}
	if n := failed.Load(); n > 0 {
		t.Fatalf("%d of %d calls failed; the first: %v", n, keys*callers, firstErr.Load())
	}
}

func TestDoUnderStrictIsolationDefaults(t *testing.T) {
	t.Parallel()
	for _, level := range strictLevels {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			b.pool = isolatedPool(t, level)
			f := newFence(t, b, idempotency.FenceConfig{})
			raceKeys(t, 30, 12, func(key string, runs *atomic.Int64) error {
				got, err := f.Do(context.Background(), key, func(context.Context) ([]byte, error) {
					runs.Add(1)
					return []byte("receipt"), nil
				})
				switch {
				case errors.Is(err, idempotency.ErrInProgress):
					return nil
				case err != nil:
					return err
				case string(got) != "receipt":
					return fmt.Errorf("got %q, want the stored receipt", got)
				}
				return nil
			})
		})
	}
}

func TestMiddlewareUnderStrictIsolationDefaults(t *testing.T) {
	t.Parallel()
	for _, mode := range modes {
		for _, level := range strictLevels {
			t.Run(mode.String()+"/"+level, func(t *testing.T) {
				t.Parallel()
				b := setup(t)
				b.pool = isolatedPool(t, level)
				var runs atomic.Pointer[atomic.Int64]
				srv := newServer(t, b, idempotency.Config{Mode: mode}, func(w http.ResponseWriter, r *http.Request) {
					runs.Load().Add(1)
					w.WriteHeader(http.StatusCreated)
				})
				var mu sync.Mutex
				raceKeys(t, 20, 8, func(key string, keyRuns *atomic.Int64) error {
					mu.Lock()
					runs.Store(keyRuns) // every caller of one key stores the same counter
					mu.Unlock()
					r, err := trySend(srv.URL, request{key: key, body: "{}"})
					switch {
					case err != nil:
						return err
					case r.status == http.StatusCreated, r.status == http.StatusConflict: // run or replayed; in progress
						return nil
					}
					return fmt.Errorf("answered %d: %s", r.status, r.body)
				})
			})
		}
	}
}
