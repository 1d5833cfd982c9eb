package idempotency_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// A Leased claim and Do's claim commit on their own (autocommit), so the
// claim can commit on the server while its caller never learns it: the
// caller's context is cancelled while the answer is on its way (pgx then
// breaks the connection), or the connection breaks by itself. Nobody then
// holds the claim or renews it, and every retry of the request (or call) got
// "in progress" until its lease lapsed (a minute by default), though the
// handler never ran.

// heldAnswerConn is a database connection that can hold back the answer to
// one claim statement after the server committed it. While held, a deadline
// set on the connection (pgx's answer to a cancelled context) fails the
// read at once, as it would with the answer still in flight.
type heldAnswerConn struct {
	net.Conn
	hold     atomic.Bool
	answers  *heldAnswers
	deadline chan struct{}
	once     sync.Once
}

// heldAnswers arms the pool's next claim statement and tells the test when
// its answer is held; release lets it through (or loses it, when lose is set).
type heldAnswers struct {
	armed   atomic.Bool
	held    chan struct{}
	release chan struct{}
	lose    atomic.Bool
	fatal   atomic.Bool // answer with a FATAL error instead
}

var errAnswerLost = errors.New("test: connection reset after the claim committed")

func (c *heldAnswerConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if !c.hold.Load() {
		return n, err
	}
	// The claim is one SELECT (its INSERT in a CTE): hold the read carrying
	// its CommandComplete and the ReadyForQuery after the commit.
	i := bytes.Index(p[:n], []byte("SELECT 1\x00"))
	if i < 0 || !bytes.Contains(p[i:n], []byte{'Z', 0, 0, 0, 5}) {
		return n, err
	}
	c.hold.Store(false)
	close(c.answers.held)
	select {
	case <-c.answers.release:
		if c.answers.fatal.Load() {
			// The backend terminated after its commit (a switchover
			// waiting on a synchronous standby): a FATAL error instead
			// of the answer.
			fields := "SFATAL\x00VFATAL\x00C57P01\x00Mterminating connection due to administrator command\x00\x00"
			msg := binary.BigEndian.AppendUint32([]byte{'E'}, uint32(len(fields)+4))
			return copy(p, append(msg, fields...)), nil
		}
		if c.answers.lose.Load() {
			_ = c.Conn.Close()
			return 0, errAnswerLost
		}
		return n, err
	case <-c.deadline:
		return 0, os.ErrDeadlineExceeded
	}
}

func (c *heldAnswerConn) SetDeadline(t time.Time) error {
	if !t.IsZero() {
		c.once.Do(func() { close(c.deadline) })
	}
	return c.Conn.SetDeadline(t)
}

func (h *heldAnswers) TraceQueryStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "ON CONFLICT (scope, key) DO NOTHING") && h.armed.CompareAndSwap(true, false) {
		conn.PgConn().Conn().(*heldAnswerConn).hold.Store(true)
	}
	return ctx
}

func (*heldAnswers) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// heldAnswerBundle is b with a pool whose next claim's answer is held.
func heldAnswerBundle(t *testing.T, b bundle) (bundle, *heldAnswers) {
	t.Helper()
	h := &heldAnswers{held: make(chan struct{}), release: make(chan struct{})}
	h.armed.Store(true)
	pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.Tracer = h
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &heldAnswerConn{Conn: c, answers: h, deadline: make(chan struct{})}, nil
		}
	})
	return bundle{pool: pool, schema: b.schema}, h
}

// retryUntilNotInProgress sends req until it is not answered 409, for 10 s.
func retryUntilNotInProgress(t *testing.T, srv string, req request) response {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		r, err := trySend(srv, req)
		if err != nil {
			t.Fatal(err)
		}
		if r.status != http.StatusConflict || time.Now().After(deadline) {
			return r
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// heldAnswerLeasedServer is a Leased server on a pool whose next claim's
// answer is held, and the count of its handler's runs (each answers 201).
func heldAnswerLeasedServer(t *testing.T) (*httptest.Server, *heldAnswers, *atomic.Int64) {
	t.Helper()
	b, answers := heldAnswerBundle(t, setup(t))
	runs := &atomic.Int64{}
	srv := newServer(t, b, idempotency.Config{Mode: idempotency.Leased, Lease: time.Minute}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})
	return srv, answers, runs
}

// wantRetryRunsOnce sends a request under key whose claim meets what
// happened (5xx), then its retry, which must run the handler at once.
func wantRetryRunsOnce(t *testing.T, srv *httptest.Server, runs *atomic.Int64, key, what string) {
	t.Helper()
	if r := send(t, srv, request{key: key, body: "{}"}); r.status < 500 {
		t.Fatalf("request %s: %d, want a 5xx", what, r.status)
	}
	if r := retryUntilNotInProgress(t, srv.URL, request{key: key, body: "{}"}); r.status != http.StatusCreated {
		t.Fatalf("retry of a request %s: %d for 10 s, want 201", what, r.status)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1 (the retry)", n)
	}
}

func TestLeasedClaimWhoseClientLeftBeforeItsAnswerDoesNotHoldTheKey(t *testing.T) {
	t.Parallel()
	srv, answers, runs := heldAnswerLeasedServer(t)

	ctx, cancel := context.WithCancel(context.Background())
	sent := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader("{}"))
		req.Header.Set(idempotency.KeyHeader, "k-left")
		req.Header.Set("X-User", "alice")
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		sent <- err
	}()
	<-answers.held // the claim committed; its answer is on its way
	cancel()       // and the client leaves
	if err := <-sent; !errors.Is(err, context.Canceled) {
		t.Fatalf("client: %v, want context.Canceled", err)
	}
	time.Sleep(200 * time.Millisecond) // the server notices the closed connection
	close(answers.release)

	if r := retryUntilNotInProgress(t, srv.URL, request{key: "k-left", body: "{}"}); r.status != http.StatusCreated {
		t.Fatalf("retry of a request whose client left before its claim's answer: %d for 10 s, want 201: "+
			"the handler never ran, yet its claim held the key for a lease (1 min)", r.status)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1 (the retry)", n)
	}
}

func TestLeasedClaimWhoseAnswerWasLostDoesNotHoldTheKey(t *testing.T) {
	t.Parallel()
	srv, answers, runs := heldAnswerLeasedServer(t)
	answers.lose.Store(true)
	close(answers.release)
	wantRetryRunsOnce(t, srv, runs, "k-lost", "whose claim's answer was lost")
	// The claim may have been an heir's, or a takeover's: the key stays the
	// same request's, so another body under it is refused.
	if r := send(t, srv, request{key: "k-lost", body: `{"other":1}`}); r.status != http.StatusUnprocessableEntity {
		t.Fatalf("other body under the key: %d, want 422", r.status)
	}
}

func TestDoCancelledBeforeItsClaimsAnswerDoesNotHoldTheKey(t *testing.T) {
	t.Parallel()
	b, answers := heldAnswerBundle(t, setup(t))
	fence, err := idempotency.NewFence(b.pool, &idempotency.FenceConfig{Schema: b.schema, Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	fn := func(context.Context) ([]byte, error) {
		runs.Add(1)
		return []byte("charged"), nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	returned := make(chan error, 1)
	go func() {
		_, err := fence.Do(ctx, "k-cancelled", fn)
		returned <- err
	}()
	<-answers.held
	cancel()
	time.Sleep(200 * time.Millisecond)
	close(answers.release)
	select {
	case err := <-returned:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled Do: %v, want context.Canceled", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Do did not return within 5 s of its context's cancellation")
	}
	if runs.Load() != 0 {
		t.Fatal("a cancelled Do ran fn")
	}

	deadline := time.Now().Add(10 * time.Second)
	for {
		got, err := fence.Do(context.Background(), "k-cancelled", fn)
		if err == nil {
			if string(got) != "charged" {
				t.Fatalf("Do returned %q", got)
			}
			break
		}
		if !errors.Is(err, idempotency.ErrInProgress) || time.Now().After(deadline) {
			t.Fatalf("Do after a call cancelled before its claim's answer: %v after 10 s, want fn to run: "+
				"fn never ran, yet the claim held the key for a lease (1 min)", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("fn ran %d times, want 1", n)
	}
}

// claimCounter counts claim statements and, while delay is set, holds each
// for that long before it is sent.
type claimCounter struct {
	claims atomic.Int64
	delay  atomic.Int64  // time.Duration
	hold   chan struct{} // when non-nil, each claim waits on it
}

func (c *claimCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "ON CONFLICT (scope, key) DO NOTHING") {
		c.claims.Add(1)
		if d := time.Duration(c.delay.Load()); d > 0 {
			time.Sleep(d)
		}
		if c.hold != nil {
			<-c.hold
		}
	}
	return ctx
}

func (*claimCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// helper 117: the detached claim took its connection detached too. Under
// a saturated pool, every caller that gave up while waiting for a
// connection left a goroutine in the pool's queue, ahead of live callers,
// which then ran a claim (and its release) for nobody: an overload
// amplifier. A caller gone before its statement was sent sends nothing.
func TestDoCancelledWhileWaitingForAConnectionSendsNoClaim(t *testing.T) {
	t.Parallel()
	b := setup(t)
	counter := &claimCounter{}
	pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.Tracer = counter
		cfg.MaxConns = 1
	})
	fence, err := idempotency.NewFence(pool, &idempotency.FenceConfig{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	busy, err := pool.Acquire(context.Background()) // the pool's only connection
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for i := range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			defer cancel()
			if _, err := fence.Do(ctx, fmt.Sprint("k-queued-", i), func(context.Context) ([]byte, error) { return nil, nil }); !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("Do with a connection never free: %v, want context.DeadlineExceeded", err)
			}
		}()
	}
	wg.Wait()
	busy.Release()
	time.Sleep(500 * time.Millisecond)
	if n := counter.claims.Load(); n != 0 {
		t.Fatalf("%d claims sent for callers gone before a connection was free, want 0", n)
	}
}

// helper 117: the detached claim was bounded by a lease for every caller.
// A live caller whose claim took longer than the lease (a slow database,
// a short lease) failed with DeadlineExceeded though its context was live.
func TestDoWithALiveContextIsNotBoundedByTheLease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	counter := &claimCounter{}
	counter.delay.Store(int64(300 * time.Millisecond))
	pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = counter })
	fence, err := idempotency.NewFence(pool, &idempotency.FenceConfig{Schema: b.schema, Lease: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	got, err := fence.Do(context.Background(), "k-slow", func(context.Context) ([]byte, error) { return []byte("ran"), nil })
	if err != nil || string(got) != "ran" {
		t.Fatalf("Do with a live context and a claim slower than the lease: %q, %v; want it to run", got, err)
	}
}

// helper 117: a caller cancelled with a cause of its own
// (context.WithCancelCause, WithTimeoutCause) got the cause alone: not
// errors.Is context.Canceled any more, and the middleware answered 500
// (and logged it) instead of 503.
func TestDoCancelledWithACauseIsStillCanceled(t *testing.T) {
	t.Parallel()
	b := setup(t)
	counter := &claimCounter{hold: make(chan struct{})}
	pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = counter })
	t.Cleanup(func() { close(counter.hold) })
	fence, err := idempotency.NewFence(pool, &idempotency.FenceConfig{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	errShutdown := errors.New("shutting down")
	ctx, cancel := context.WithCancelCause(context.Background())
	returned := make(chan error, 1)
	go func() {
		_, err := fence.Do(ctx, "k-cause", func(context.Context) ([]byte, error) { return nil, nil })
		returned <- err
	}()
	waitFor(t, 5*time.Second, "the claim to be sent", func() bool { return counter.claims.Load() == 1 })
	cancel(errShutdown)
	err = <-returned
	if !errors.Is(err, context.Canceled) || !errors.Is(err, errShutdown) {
		t.Fatalf("Do cancelled with a cause: %v; want both context.Canceled and the cause", err)
	}
	if code := idempotency.StatusCode(err); code != http.StatusServiceUnavailable {
		t.Fatalf("StatusCode = %d, want 503", code)
	}
}

// helper 117: a PgError can come after the commit: a backend terminated
// (FATAL 57P01) while it waited for a synchronous standby has committed
// locally. Taken for "nothing committed", the claim was left to hold the
// key for a lease.
func TestLeasedClaimAnsweredWithAFatalErrorDoesNotHoldTheKey(t *testing.T) {
	t.Parallel()
	srv, answers, runs := heldAnswerLeasedServer(t)
	answers.fatal.Store(true)
	close(answers.release)
	wantRetryRunsOnce(t, srv, runs, "k-fatal", "whose claim was answered FATAL after its commit")
}
