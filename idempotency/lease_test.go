package idempotency_test

import (
	"context"
	"errors"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// waitPastWindow waits until the database clock has passed the expiry of
// every record in b's table.
func waitPastWindow(t *testing.T, b bundle) {
	t.Helper()
	table := pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()
	waitFor(t, 30*time.Second, "the claim's window to pass", func() bool {
		var passed bool
		err := b.pool.QueryRow(context.Background(), `SELECT count(*) > 0 AND bool_and(expires_at <= now()) FROM `+table).Scan(&passed)
		if err != nil {
			t.Fatal(err)
		}
		return passed
	})
}

func TestDoClaimHeldPastItsWindowIsNotTakenOver(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// Window = Lease: the record's window ends while fn still runs with its
	// lease renewed.
	f := newFence(t, b, idempotency.FenceConfig{Lease: 3 * time.Second, Window: 3 * time.Second})
	started, release := make(chan struct{}), make(chan struct{})
	var runs atomic.Int64
	done := make(chan error, 1)
	go func() {
		_, err := f.Do(context.Background(), "k", func(ctx context.Context) ([]byte, error) {
			runs.Add(1)
			close(started)
			select {
			case <-release:
				return []byte("first"), nil
			case <-ctx.Done():
				return nil, context.Cause(ctx)
			}
		})
		done <- err
	}()
	<-started
	waitPastWindow(t, b)
	if _, err := f.Do(context.Background(), "k", func(context.Context) ([]byte, error) {
		runs.Add(1)
		return []byte("second"), nil
	}); !errors.Is(err, idempotency.ErrInProgress) {
		t.Errorf("Do while the first still runs past the window: %v, want ErrInProgress", err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatalf("first Do: %v", err)
	}
	if runs.Load() != 1 {
		t.Fatalf("fn ran %d times, want 1", runs.Load())
	}
}

func TestLeasedClaimHeldPastItsWindowIsNotTakenOver(t *testing.T) {
	t.Parallel()
	b := setup(t)
	started, release := make(chan struct{}), make(chan struct{})
	var runs atomic.Int64
	srv := newServer(t, b, idempotency.Config{Mode: idempotency.Leased, Lease: 3 * time.Second, Window: 3 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) == 1 {
				close(started)
				select {
				case <-release:
				case <-r.Context().Done():
					http.Error(w, "cancelled", http.StatusServiceUnavailable)
					return
				}
			}
			w.WriteHeader(http.StatusCreated)
		})
	done := make(chan response, 1)
	go func() { done <- send(t, srv, request{key: "slow", body: "{}"}) }()
	<-started
	waitPastWindow(t, b)
	if r := send(t, srv, request{key: "slow", body: "{}"}); r.status != http.StatusConflict {
		t.Errorf("retry while the first still runs past the window: %d, want 409", r.status)
	}
	close(release)
	if r := <-done; r.status != http.StatusCreated || r.replayed {
		t.Fatalf("first: %+v", r)
	}
	if runs.Load() != 1 {
		t.Fatalf("handler ran %d times, want 1", runs.Load())
	}
}

// lockClaim makes the claim's lease renewals fail the way a real outage of
// the row does: another transaction holds the row lock, so every renewal
// blocks until its timeout. It returns the function that lets go.
func lockClaim(t *testing.T, b bundle) (unlock func()) {
	t.Helper()
	conn := pgtest.Conn(t)
	ctx := context.Background()
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var n int
	if err := tx.QueryRow(ctx, `WITH l AS (SELECT FROM `+pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()+
		` FOR UPDATE) SELECT count(*) FROM l`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("lock the claim: %d rows, %v", n, err)
	}
	return func() { _ = tx.Rollback(ctx) }
}

// leaseHeld reports whether the claim's lease still holds by the database
// clock. It may run outside the test's goroutine.
func leaseHeld(t *testing.T, b bundle) bool {
	var held bool
	err := b.pool.QueryRow(context.Background(), `SELECT coalesce(bool_and(lease_until > clock_timestamp()), false) FROM `+
		pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()).Scan(&held)
	if err != nil {
		t.Error(err)
	}
	return held
}

// awaitCancelBeforeLapse blocks until ctx is done or the lease lapses, and
// fails the test unless ctx was cancelled for a lost lease while the lease
// still held (so no other caller can have started the work).
func awaitCancelBeforeLapse(t *testing.T, b bundle, ctx context.Context) {
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case <-ctx.Done():
			if !leaseHeld(t, b) {
				t.Error("cancelled only after the lease lapsed")
			}
			if !errors.Is(context.Cause(ctx), idempotency.ErrLeaseLost) {
				t.Errorf("cancelled with cause %v, want ErrLeaseLost", context.Cause(ctx))
			}
			return
		case <-time.After(20 * time.Millisecond):
		}
		if !leaseHeld(t, b) {
			t.Error("the lease lapsed while the work still ran: another caller could run it concurrently")
			return
		}
		if time.Now().After(deadline) {
			t.Error("not cancelled within 30s")
			return
		}
	}
}

func TestDoCancelsFnBeforeTheLeaseLapsesWhenRenewalsFail(t *testing.T) {
	t.Parallel()
	b := setup(t)
	f := newFence(t, b, idempotency.FenceConfig{Lease: 3 * time.Second})
	started, locked, finished := make(chan struct{}), make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := f.Do(context.Background(), "k", func(ctx context.Context) ([]byte, error) {
			close(started)
			<-locked
			awaitCancelBeforeLapse(t, b, ctx)
			close(finished)
			return nil, context.Cause(ctx)
		})
		done <- err
	}()
	<-started
	unlock := lockClaim(t, b)
	close(locked)
	<-finished // awaitCancelBeforeLapse gives up after 30s
	unlock()   // the release of the claim waits for the row
	err := <-done
	if !errors.Is(err, idempotency.ErrLeaseLost) {
		t.Fatalf("Do = %v, want ErrLeaseLost", err)
	}
	// fn failed, so its claim is released and the key runs again.
	waitFor(t, 30*time.Second, "the key to run again", func() bool {
		got, err := f.Do(context.Background(), "k", func(context.Context) ([]byte, error) { return []byte("again"), nil })
		if err != nil && !errors.Is(err, idempotency.ErrInProgress) {
			t.Fatal(err)
		}
		return err == nil && string(got) == "again"
	})
}

func TestLeasedHandlerCancelledBeforeTheLeaseLapsesWhenRenewalsFail(t *testing.T) {
	t.Parallel()
	b := setup(t)
	started, locked, finished := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var runs atomic.Int64
	srv := newServer(t, b, idempotency.Config{Mode: idempotency.Leased, Lease: 3 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) == 1 {
				close(started)
				<-locked
				awaitCancelBeforeLapse(t, b, r.Context())
				close(finished)
				http.Error(w, "cancelled", http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
	done := make(chan response, 1)
	go func() { done <- send(t, srv, request{key: "k", body: "{}"}) }()
	<-started
	unlock := lockClaim(t, b)
	close(locked)
	<-finished
	unlock()
	first := <-done
	if first.status != http.StatusServiceUnavailable {
		t.Fatalf("first: %+v, want the handler's 503", first)
	}
	waitFor(t, 30*time.Second, "the key to run again", func() bool {
		return send(t, srv, request{key: "k", body: "{}"}).status == http.StatusCreated
	})
}
