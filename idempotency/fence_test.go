package idempotency_test

import (
	"context"
	"crypto/rand"
	"errors"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/idempotency"
)

func newFence(t *testing.T, b bundle, cfg idempotency.FenceConfig) *idempotency.Fence {
	t.Helper()
	cfg.Schema = b.schema
	f, err := idempotency.NewFence(b.pool, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func TestDoRunsOnceUnderConcurrency(t *testing.T) {
	t.Parallel()
	b := setup(t)
	f := newFence(t, b, idempotency.FenceConfig{})
	const n = 20
	var runs, answered atomic.Int64
	results := make([][]byte, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = f.Do(context.Background(), "charge-1", func(ctx context.Context) ([]byte, error) {
				runs.Add(1)
				if idempotency.ClientKey(ctx) != "charge-1" {
					t.Errorf("ClientKey(ctx) = %q", idempotency.ClientKey(ctx))
				}
				deadline := time.Now().Add(10 * time.Second)
				for answered.Load() < n/2 && time.Now().Before(deadline) {
					time.Sleep(5 * time.Millisecond)
				}
				return []byte("receipt-1"), nil
			})
			answered.Add(1)
		}()
	}
	wg.Wait()
	if runs.Load() != 1 {
		t.Fatalf("fn ran %d times, want 1", runs.Load())
	}
	inProgress := 0
	for i := range n {
		switch {
		case errors.Is(errs[i], idempotency.ErrInProgress):
			inProgress++
		case errs[i] != nil:
			t.Errorf("caller %d: %v", i, errs[i])
		case string(results[i]) != "receipt-1":
			t.Errorf("caller %d got %q", i, results[i])
		}
	}
	if inProgress < n/2 {
		t.Errorf("%d callers saw ErrInProgress while fn was held open, want at least %d", inProgress, n/2)
	}
	got, err := f.Do(context.Background(), "charge-1", func(context.Context) ([]byte, error) {
		t.Error("fn ran again after success")
		return nil, nil
	})
	if err != nil || string(got) != "receipt-1" {
		t.Fatalf("later Do: %q, %v", got, err)
	}
}

func TestDoTakesOverAnExpiredLease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	f := newFence(t, b, idempotency.FenceConfig{Namespace: "payments"})
	table := pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()
	// A claim whose holder died: running, lease ends in 500ms.
	var leaseUntil time.Time
	err := b.pool.QueryRow(context.Background(), `INSERT INTO `+table+` (scope, key, fingerprint, token, lease_until, expires_at)
VALUES ('do:payments', 'charge-2', '', gen_random_uuid(), now() + interval '500 milliseconds', now() + interval '1 hour')
RETURNING lease_until`).Scan(&leaseUntil)
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	fn := func(context.Context) ([]byte, error) { runs.Add(1); return []byte("ok"), nil }
	if _, err := f.Do(context.Background(), "charge-2", fn); !errors.Is(err, idempotency.ErrInProgress) {
		t.Fatalf("Do while the dead claim's lease holds: %v, want ErrInProgress", err)
	}
	// Another namespace is another key.
	other := newFence(t, b, idempotency.FenceConfig{Namespace: "emails"})
	if _, err := other.Do(context.Background(), "charge-2", fn); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the lease to lapse and Do to run", func() bool {
		_, err := f.Do(context.Background(), "charge-2", fn)
		if err != nil && !errors.Is(err, idempotency.ErrInProgress) {
			t.Fatal(err)
		}
		return err == nil
	})
	var takenAt time.Time
	if err := b.pool.QueryRow(context.Background(), `SELECT created_at FROM `+table+` WHERE scope = 'do:payments'`).Scan(&takenAt); err != nil {
		t.Fatal(err)
	}
	if takenAt.Before(leaseUntil) {
		t.Fatalf("taken over at %s, before the lease ended at %s", takenAt, leaseUntil)
	}
	if runs.Load() != 2 {
		t.Fatalf("fn ran %d times, want 2 (one per namespace)", runs.Load())
	}
}

func TestDoReleasesOnErrorAndPanic(t *testing.T) {
	t.Parallel()
	b := setup(t)
	f := newFence(t, b, idempotency.FenceConfig{})
	boom := errors.New("gateway timeout")
	if _, err := f.Do(context.Background(), "k", func(context.Context) ([]byte, error) { return nil, boom }); !errors.Is(err, boom) {
		t.Fatalf("Do = %v, want fn's error", err)
	}
	func() {
		defer func() {
			if v := recover(); v != "kaboom" {
				t.Errorf("recovered %v, want the fn's panic", v)
			}
		}()
		_, _ = f.Do(context.Background(), "k", func(context.Context) ([]byte, error) { panic("kaboom") })
	}()
	if b.records(t) != 0 {
		t.Fatalf("%d records after failures, want 0", b.records(t))
	}
	got, err := f.Do(context.Background(), "k", func(context.Context) ([]byte, error) { return []byte("done"), nil })
	if err != nil || string(got) != "done" {
		t.Fatalf("Do after failures: %q, %v", got, err)
	}
}

func TestDoOversizedResult(t *testing.T) {
	t.Parallel()
	b := setup(t)
	f := newFence(t, b, idempotency.FenceConfig{MaxResultBytes: 4})
	got, err := f.Do(context.Background(), "k", func(context.Context) ([]byte, error) { return []byte("too long"), nil })
	if err != nil || string(got) != "too long" {
		t.Fatalf("first Do: %q, %v", got, err)
	}
	if _, err := f.Do(context.Background(), "k", func(context.Context) ([]byte, error) {
		t.Error("ran again")
		return nil, nil
	}); !errors.Is(err, idempotency.ErrNotStored) {
		t.Fatalf("second Do: %v, want ErrNotStored", err)
	}
}

func TestDoLeaseLostCancelsFn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	f := newFence(t, b, idempotency.FenceConfig{Lease: 150 * time.Millisecond})
	table := pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()
	_, err := f.Do(context.Background(), "k", func(ctx context.Context) ([]byte, error) {
		// Someone deletes the claim (an operator, a purge gone wrong): the
		// next renewal notices and cancels fn.
		if _, err := b.pool.Exec(ctx, `DELETE FROM `+table); err != nil {
			return nil, err
		}
		select {
		case <-ctx.Done():
			if !errors.Is(context.Cause(ctx), idempotency.ErrLeaseLost) {
				t.Errorf("cause %v, want ErrLeaseLost", context.Cause(ctx))
			}
			return []byte("late"), nil
		case <-time.After(10 * time.Second):
			t.Error("fn not cancelled after its claim vanished")
			return nil, nil
		}
	})
	if !errors.Is(err, idempotency.ErrLeaseLost) {
		t.Fatalf("Do = %v, want ErrLeaseLost", err)
	}
}

func TestPurgeDeletesExpiredRecordsInBatches(t *testing.T) {
	t.Parallel()
	b := setup(t)
	table := pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()
	_, err := b.pool.Exec(context.Background(), `INSERT INTO `+table+` (scope, key, fingerprint, state, token, lease_until, expires_at)
SELECT 'do:x', 'old-' || i, ''::bytea, 'done', gen_random_uuid(), NULL::timestamptz, now() - interval '1 minute' FROM generate_series(1, 7) i
UNION ALL SELECT 'do:x', 'fresh', '', 'done', gen_random_uuid(), NULL, now() + interval '1 hour'
UNION ALL SELECT 'do:x', 'held', '', 'running', gen_random_uuid(), now() + interval '1 hour', now() - interval '1 minute'`)
	if err != nil {
		t.Fatal(err)
	}
	p, err := idempotency.NewPurger(b.pool, &idempotency.PurgeConfig{Schema: b.schema, BatchSize: 3})
	if err != nil {
		t.Fatal(err)
	}
	n, err := p.Purge(context.Background())
	if err != nil || n != 7 {
		t.Fatalf("Purge = %d, %v; want 7", n, err)
	}
	var left []string
	rows, _ := b.pool.Query(context.Background(), `SELECT key FROM `+table+` ORDER BY key`)
	left, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(left) != 2 || left[0] != "fresh" || left[1] != "held" {
		t.Fatalf("left %v (%v), want [fresh held]", left, err)
	}
	if n, err := p.Purge(context.Background()); n != 0 || err != nil {
		t.Fatalf("second Purge = %d, %v", n, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := p.Run(ctx); err != nil {
		t.Fatalf("Run after cancel = %v", err)
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	pool := setup(t).pool
	tests := []struct {
		name  string
		build func() error
		field string
	}{
		{"mode", func() error {
			_, err := idempotency.New(pool, &idempotency.Config{Scope: idempotency.SharedScope, Mode: 7})
			return err
		}, "Config.Mode"},
		{"lease", func() error {
			_, err := idempotency.New(pool, &idempotency.Config{Scope: idempotency.SharedScope, Lease: time.Millisecond})
			return err
		}, "Config.Lease"},
		{"window", func() error {
			_, err := idempotency.New(pool, &idempotency.Config{Scope: idempotency.SharedScope, Mode: idempotency.Leased, Window: time.Minute, Lease: time.Hour})
			return err
		}, "Config.Window"},
		{"key length", func() error {
			_, err := idempotency.New(pool, &idempotency.Config{Scope: idempotency.SharedScope, MaxKeyLength: -1})
			return err
		}, "Config.MaxKeyLength"},
		{"schema", func() error {
			_, err := idempotency.New(pool, &idempotency.Config{Scope: idempotency.SharedScope, Schema: string(make([]byte, 64))})
			return err
		}, "Config.Schema"},
		{"fence lease", func() error {
			_, err := idempotency.NewFence(pool, &idempotency.FenceConfig{Lease: time.Microsecond})
			return err
		}, "FenceConfig.Lease"},
		{"purge batch", func() error {
			_, err := idempotency.NewPurger(pool, &idempotency.PurgeConfig{BatchSize: -1})
			return err
		}, "PurgeConfig.BatchSize"},
	}
	for _, tt := range tests {
		err := tt.build()
		if err == nil || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("%s: error %v, want one naming %s", tt.name, err, tt.field)
		}
	}
	for _, build := range []func() error{ // nil or minimal configs
		func() error {
			_, err := idempotency.New(pool, &idempotency.Config{Scope: idempotency.SharedScope})
			return err
		},
		func() error { _, err := idempotency.NewFence(pool, nil); return err },
		func() error { _, err := idempotency.NewPurger(pool, nil); return err },
	} {
		if err := build(); err != nil {
			t.Errorf("nil config: %v", err)
		}
	}
}

func TestStatusCode(t *testing.T) {
	t.Parallel()
	for err, want := range map[error]int{
		idempotency.ErrKeyMissing:                          http.StatusBadRequest,
		idempotency.ErrKeyInvalid:                          http.StatusBadRequest,
		&idempotency.ScopeError{Err: errors.New("no one")}: http.StatusUnauthorized,
		idempotency.ErrInProgress:                          http.StatusConflict,
		idempotency.ErrRequestTooLarge:                     http.StatusRequestEntityTooLarge,
		idempotency.ErrMismatch:                            http.StatusUnprocessableEntity,
		idempotency.ErrNotStored:                           http.StatusUnprocessableEntity,
		errors.New("db down"):                              http.StatusInternalServerError,
	} {
		if got := idempotency.StatusCode(err); got != want {
			t.Errorf("StatusCode(%v) = %d, want %d", err, got, want)
		}
	}
}

func TestExpiredRecordRunsAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	table := pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()
	_, err := b.pool.Exec(context.Background(), `INSERT INTO `+table+` (scope, key, fingerprint, state, token, body, expires_at)
VALUES ('do:default', 'k', '', 'done', gen_random_uuid(), 'stale', now() - interval '1 second')`)
	if err != nil {
		t.Fatal(err)
	}
	f := newFence(t, b, idempotency.FenceConfig{})
	got, err := f.Do(context.Background(), "k", func(context.Context) ([]byte, error) { return []byte("fresh"), nil })
	if err != nil || string(got) != "fresh" {
		t.Fatalf("Do over an expired record: %q, %v; want a fresh run", got, err)
	}
	if got, err := f.Do(context.Background(), "k", nil); err != nil || string(got) != "fresh" {
		t.Fatalf("replay: %q, %v", got, err)
	}
}

// A key too long for the records' index is bad input, said so
// (ErrKeyInvalid), not a database error on every call; fn does not run.
func TestDoRefusesAKeyTooLongForTheIndex(t *testing.T) {
	t.Parallel()
	b := setup(t)
	f := newFence(t, b, idempotency.FenceConfig{})
	var key strings.Builder
	for key.Len() < 3000 {
		key.WriteString(rand.Text()) // random: not compressed into the index
	}
	ran := false
	_, err := f.Do(context.Background(), key.String(), func(context.Context) ([]byte, error) {
		ran = true
		return nil, nil
	})
	if !errors.Is(err, idempotency.ErrKeyInvalid) || ran {
		t.Fatalf("Do with a 3,000-byte key: %v (fn ran: %v), want ErrKeyInvalid and no run", err, ran)
	}
}
