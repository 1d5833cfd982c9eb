package idempotency_test

// Defects a cold review (helper 78) found; each test failed on the code
// before its fix, as its comment says.

import (
	"bytes"
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// A Leased handler runs on the request's context, so a client that gives up
// cancels it. A handler that returns without writing when its context ends
// (common in Go: nobody is left to answer) must not be stored as a success:
// the work never happened. The key is released and the retry runs the
// handler. Before the fix the recorder's default 200 was stored, and the
// retry was answered a replayed 200 with an empty body, the handler having
// run once and never completed.
func TestLeasedHandlerWhoseClientLeftAndThatWroteNothingIsRunAgainOnRetry(t *testing.T) {
	clientGoneHandlerWroteNothing(t, idempotency.Leased)
}

// Transactional mode already got this right (the commit fails on the
// cancelled context); it is kept so.
func TestTransactionalHandlerWhoseClientLeftAndThatWroteNothingIsRunAgainOnRetry(t *testing.T) {
	clientGoneHandlerWroteNothing(t, idempotency.Transactional)
}

func clientGoneHandlerWroteNothing(t *testing.T, mode idempotency.Mode) {
	t.Parallel()
	b := setup(t)
	var runs, completed atomic.Int64
	srv := newServer(t, b, idempotency.Config{Mode: mode},
		func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			select {
			case <-time.After(time.Second): // the downstream call
				completed.Add(1)
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write([]byte(`{"charged":true}`))
			case <-r.Context().Done():
				return // the client is gone: nothing to answer
			}
		})
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader("{}"))
	req.Header.Set(idempotency.KeyHeader, "pay-1")
	req.Header.Set("X-User", "alice")
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
		t.Fatal("the first try did not time out")
	}
	var got response
	waitFor(t, 10*time.Second, "the retry not to be 409", func() bool {
		got = send(t, srv, request{key: "pay-1", body: "{}"})
		return got.status != http.StatusConflict
	})
	if got.replayed || got.status != http.StatusCreated || completed.Load() != 1 {
		t.Fatalf("retry: %d %q (replayed %v); the handler ran %d times and completed %d, want a fresh 201 from a second run",
			got.status, got.body, got.replayed, runs.Load(), completed.Load())
	}
}

// The same through a lost lease: renewals fail, the middleware cancels the
// handler's context with ErrLeaseLost, and the handler stops without
// writing. Nothing is stored (another holder may own the key), the client
// is answered 503 and the key is released, so the retry runs the handler.
// Before the fix the client was answered an empty 200 for work it had been
// told to abandon, and the 200 was stored and replayed to every retry.
func TestLeasedHandlerStoppedForALostLeaseThatWroteNothingIsAnswered503AndRunAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	started, locked := make(chan struct{}), make(chan struct{})
	var runs, completed atomic.Int64
	srv := newServer(t, b, idempotency.Config{Mode: idempotency.Leased, Lease: 3 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) > 1 {
				completed.Add(1)
				w.WriteHeader(http.StatusCreated)
				return
			}
			close(started)
			<-locked
			select {
			case <-time.After(10 * time.Second): // the downstream call
				completed.Add(1)
				w.WriteHeader(http.StatusCreated)
			case <-r.Context().Done():
				return // told to stop
			}
		})
	done := make(chan response, 1)
	go func() { done <- send(t, srv, request{key: "k", body: "{}"}) }()
	<-started
	unlock := lockClaim(t, b)
	close(locked)
	time.Sleep(3 * time.Second) // past Lease*5/6: the handler is cancelled
	unlock()
	first := <-done
	if first.status != http.StatusServiceUnavailable {
		t.Fatalf("first: %d %q, want 503: the handler was told to stop and answered nothing", first.status, first.body)
	}
	var retry response
	waitFor(t, 10*time.Second, "the retry not to be 409", func() bool {
		retry = send(t, srv, request{key: "k", body: "{}"})
		return retry.status != http.StatusConflict
	})
	if retry.replayed || retry.status != http.StatusCreated || completed.Load() != 1 {
		t.Fatalf("retry: %d (replayed %v); the handler ran %d times and completed %d, want a fresh 201",
			retry.status, retry.replayed, runs.Load(), completed.Load())
	}
}

// A consumer handler is given a pgx.Tx, which satisfies DB. Passed to Do,
// the claim and the stored result would live in the consumer's transaction
// and vanish with its rollback, so the redelivery would run fn (the charge)
// again. Do refuses a transaction and names what to pass. Before the fix
// both deliveries succeeded and fn ran twice: "the card was charged 2 times".
func TestDoGivenATransactionRefusesItInsteadOfRunningFnAgainAfterItsRollback(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	var charges atomic.Int64
	deliver := func() error {
		tx, err := b.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx) // a later write of the handler failed
		return doOn(ctx, b, tx, "msg-1", func(context.Context) ([]byte, error) {
			charges.Add(1)
			return []byte("receipt"), nil
		})
	}
	for i := 0; i < 2; i++ { // the message and its redelivery
		err := deliver()
		if err == nil || !strings.Contains(err.Error(), "*pgxpool.Pool") {
			t.Errorf("delivery %d: Do given a pgx.Tx = %v, want an error naming *pgxpool.Pool", i+1, err)
		}
	}
	if n := charges.Load(); n != 0 {
		t.Fatalf("fn ran %d times on a transaction that rolled back", n)
	}
}

// Do renews its lease from a goroutine of its own while fn runs and while
// it stores the result; on a single connection (*pgx.Conn, *pgxpool.Conn)
// those renewals would share the connection with Do and with fn, which a
// pgx connection does not allow. NewFence, Do and New refuse one and name
// what to pass. Before the fix they accepted it, and 40 Do calls on a
// *pgx.Conn with a 30 ms lease were a DATA RACE under -race (the renewal
// against the store of the result, in pgconn).
func TestASingleConnectionIsRefusedRatherThanSharedWithTheLeaseRenewals(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	conn := pgtest.Conn(t)
	pconn, err := b.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer pconn.Release()
	for name, db := range map[string]idempotency.DB{"*pgx.Conn": conn, "*pgxpool.Conn": pconn} {
		var runs atomic.Int64
		err := doOn(ctx, b, db, "k", func(context.Context) ([]byte, error) {
			runs.Add(1)
			time.Sleep(25 * time.Millisecond)
			return []byte("ok"), nil
		})
		if err == nil || !strings.Contains(err.Error(), "*pgxpool.Pool") || runs.Load() != 0 {
			t.Errorf("Do on a %s: %v, fn ran %d times; want it refused, naming *pgxpool.Pool", name, err, runs.Load())
		}
		if _, err := idempotency.New(db, &idempotency.Config{Schema: b.schema, Scope: idempotency.SharedScope}); err == nil {
			t.Errorf("New accepted a %s", name)
		}
	}
	tx, err := b.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := idempotency.New(tx, &idempotency.Config{Schema: b.schema, Scope: idempotency.SharedScope}); err == nil {
		t.Error("New accepted a pgx.Tx")
	}
	if b.records(t) != 0 {
		t.Errorf("%d records written through a refused connection", b.records(t))
	}
}

// doOn is idempotency.Do on db, in b's schema.
func doOn(ctx context.Context, b bundle, db idempotency.DB, key string, fn func(context.Context) ([]byte, error)) error {
	f, err := idempotency.NewFence(db, &idempotency.FenceConfig{Schema: b.schema})
	if err != nil {
		return err
	}
	_, err = f.Do(ctx, key, fn)
	return err
}

// Transactional mode with StoreServerErrors: a handler that wrote its row
// through Tx and then failed answers 500. The 500 is stored and replayed,
// but the handler's writes roll back, as for any 5xx: the client is never
// told of a failure whose effect exists. Before the fix the row committed
// with the stored 500 (1 business row, the retry a replayed 500).
func TestTransactionalStoredServerErrorDoesNotCommitTheHandlersWrites(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var runs atomic.Int64
	srv := newServer(t, b, idempotency.Config{StoreServerErrors: true}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if err := writeEffect(r.Context(), b.pool, b.schema, "order"); err != nil {
			t.Error(err)
		}
		http.Error(w, "payment step failed", http.StatusInternalServerError)
	})
	first := send(t, srv, request{key: "k", body: "{}"})
	retry := send(t, srv, request{key: "k", body: "{}"})
	if first.status != http.StatusInternalServerError || retry.status != http.StatusInternalServerError || !retry.replayed ||
		retry.body != first.body || runs.Load() != 1 {
		t.Errorf("first %d %q, retry %d %q (replayed %v), %d runs: want the 500 stored and replayed",
			first.status, first.body, retry.status, retry.body, retry.replayed, runs.Load())
	}
	if n := b.effects(t); n != 0 {
		t.Fatalf("%d business row(s) committed with a stored 500", n)
	}
}

// An outer http.MaxBytesReader (a server-wide body limit smaller than
// MaxRequestBytes) refuses the body while the middleware reads it for the
// fingerprint: the client sent too much, so 413, as for the middleware's
// own limit. Before the fix: 500 "internal error", logged as a server
// fault.
func TestBodyOverAnOuterMaxBytesReaderIsAnswered413(t *testing.T) {
	t.Parallel()
	b := setup(t)
	h := newMiddleware(t, b, idempotency.Config{}).Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, 16)
		h.ServeHTTP(w, r)
	}))
	defer srv.Close()
	if got := send(t, srv, request{key: "k", body: strings.Repeat("x", 100)}); got.status != http.StatusRequestEntityTooLarge {
		t.Fatalf("body over an outer MaxBytesReader: %d %q, want 413", got.status, got.body)
	}
}

// A Scope returning what PostgreSQL text cannot hold (a tenant taken from
// a header with obs-text, or a NUL) is the request's fault: 400, not logged
// as a server fault. Before the fix every keyed request of such a tenant
// was a 500 "internal error", logged at Warn.
func TestScopePostgreSQLTextCannotHoldIsAnswered400(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var logged bytes.Buffer
	srv := newServer(t, b, idempotency.Config{
		Scope:  func(r *http.Request) (string, error) { return url.PathUnescape(r.Header.Get("X-Tenant")) },
		Logger: slog.New(slog.NewTextHandler(&logged, nil)),
	}, func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) })
	for _, tenant := range []string{"caf%E9", "a%00b"} {
		got := send(t, srv, request{key: "k", body: "{}", header: map[string]string{"X-Tenant": tenant}})
		if got.status != http.StatusBadRequest {
			t.Errorf("tenant %q: %d %q, want 400", tenant, got.status, got.body)
		}
	}
	if logged.Len() != 0 {
		t.Errorf("logged as a server fault:\n%s", logged.String())
	}
}

// A different body under a key whose first request still runs is answered
// 409 in both modes, as a request still being processed (the IETF draft's
// 409): in Transactional mode the running claim is not committed, so its
// fingerprint cannot be compared yet. Once the first is done, the different
// body gets 422. Before the fix Transactional answered 409 and Leased 422.
func TestDifferentBodyUnderAKeyStillInFlightIsAnswered409InBothModes(t *testing.T) {
	t.Parallel()
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			started, release := make(chan struct{}), make(chan struct{})
			srv := newServer(t, b, idempotency.Config{Mode: mode}, func(w http.ResponseWriter, r *http.Request) {
				close(started)
				<-release
				w.WriteHeader(http.StatusCreated)
			})
			done := make(chan response, 1)
			go func() { done <- send(t, srv, request{key: "k", body: `{"amount":1}`}) }()
			<-started
			during := send(t, srv, request{key: "k", body: `{"amount":2}`})
			close(release)
			<-done
			after := send(t, srv, request{key: "k", body: `{"amount":2}`})
			if during.status != http.StatusConflict || during.header.Get("Retry-After") == "" || after.status != http.StatusUnprocessableEntity {
				t.Fatalf("different body while the first runs: %d (Retry-After %q), once it is done: %d; want 409 with Retry-After, then 422",
					during.status, during.header.Get("Retry-After"), after.status)
			}
		})
	}
}
