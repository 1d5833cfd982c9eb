package consumer_test

// Defects a cold review (helper 62) found in the one-session semaphore
// (holdSession) and around it; each test failed on the code before its fix.

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

// Two partitions share a *pgx.Conn. Partition B's message waits for the
// one session while A's handler holds it. B is stopped (revoked): Stop says
// queued messages that have not started are dropped, and B's message has
// not begun any transaction. But holdSession waits on ctx only, not on the
// partition's stop: once A's handler ends, B's message takes the session,
// begins and runs its handler after its partition was stopped (the same
// defect helper 60 fixed for the batch fallback).
func TestPgxConnWaiterStartsNoMessageAfterItsPartitionStopped(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	conn := oneConn(t)
	aStarted, aRelease := make(chan struct{}), make(chan struct{})
	var bStopped atomic.Bool
	var bAfterStop atomic.Int32
	p, err := consumer.New(conn, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		switch m.ID {
		case "A":
			close(aStarted)
			<-aRelease
		case "B":
			if bStopped.Load() {
				bAfterStop.Add(1)
			}
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	trA, trB := &memTransport{}, &memTransport{}
	wA := start(t, p, trA, msg(0, "A", ""))
	defer wA.Stop(ctx)
	<-aStarted
	wB := start(t, p, trB, msg(0, "B", ""))
	time.Sleep(200 * time.Millisecond) // B's message is waiting for the session
	stopCtx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	stopDone := make(chan time.Duration, 1)
	bStopped.Store(true)
	began := time.Now()
	go func() { wB.Stop(stopCtx); stopDone <- time.Since(began) }()
	time.Sleep(100 * time.Millisecond) // Stop has closed B's partition
	close(aRelease)
	took := <-stopDone
	waitFor(t, 5*time.Second, "A marked done", func() bool { return trA.lastMark() == 0 })
	if n := bAfterStop.Load(); n != 0 {
		t.Fatalf("partition B's message, waiting for the session when B was stopped, began and ran its handler %d time(s) after Stop (Stop took %s)", n, took.Round(time.Millisecond))
	}
}

// Same setting, A's handler does not end in time: B's Stop has nothing of
// B's in a transaction, yet it waits out its whole grace (RevokeGrace, a
// rebalance held up) because the waiter for the session ignores stop.
func TestPgxConnWaiterDoesNotHoldItsPartitionsStop(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	conn := oneConn(t)
	aStarted, aRelease := make(chan struct{}), make(chan struct{})
	p, err := consumer.New(conn, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if m.ID == "A" {
			close(aStarted)
			<-aRelease
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	wA := start(t, p, &memTransport{}, msg(0, "A", ""))
	defer wA.Stop(ctx)
	defer close(aRelease)
	<-aStarted
	wB := start(t, p, &memTransport{}, msg(0, "B", ""))
	time.Sleep(200 * time.Millisecond) // B's message is waiting for the session
	stopCtx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	began := time.Now()
	wB.Stop(stopCtx)
	if took := time.Since(began); took > time.Second {
		t.Fatalf("Stop of a partition whose only message waits for the session (no transaction of its own) took %s: it waited out its whole grace (3s)", took.Round(time.Millisecond))
	}
}

// The one-session protection keys on the concrete type *pgx.Conn. A
// *pgxpool.Conn (a connection taken from a pool to dedicate it, as
// natural a choice) is one session just the same, and two lanes still run
// on it at once: B's BEGIN is a no-op inside A's open transaction, and B's
// COMMIT commits A's dedup record while A's handler is still running (and
// bound to fail). Lanes beginning at the same instant even use the
// connection concurrently, which panics inside pgx ("BUG: slow write timer
// already active"); the test queues B only once A's handler runs to keep
// the run deterministic.
func TestAPgxpoolConnRunsOneTransactionAtATime(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	pc, err := b.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Release()
	aStarted := make(chan struct{})
	var aRuns, inflight, overlap atomic.Int32
	p, err := consumer.New(pc, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if inflight.Add(1) > 1 {
			overlap.Add(1)
		}
		defer inflight.Add(-1)
		if m.ID == "A" && aRuns.Add(1) == 1 {
			close(aStarted)
			time.Sleep(300 * time.Millisecond) // B runs meanwhile, if it can
			return errors.New("transient failure, retry me")
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, Concurrency: 2, MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	w := start(t, p, tr, msg(0, "A", "a"))
	defer w.Stop(ctx)
	<-aStarted
	if err := w.Add(ctx, msg(1, "B", "b")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "offset 1 marked done", func() bool { return tr.lastMark() == 1 })
	a, bb := b.count(t, "message_id = 'A'"), b.count(t, "message_id = 'B'")
	if a != 1 || bb != 1 || overlap.Load() > 0 {
		t.Fatalf("effects: A %d, B %d (A's handler ran %d times, failing first; handlers overlapped on the one session %d times); want one each, one transaction at a time",
			a, bb, aRuns.Load(), overlap.Load())
	}
}

// The common case of the one above: a handler that honours its context but
// is still running when its partition's grace ends (a revocation with the
// default 1s RevokeGrace). Stop cancels the context; the transaction's
// rollback then runs under that canceled context, fails before it is
// sent, and pgx closes the connection ("a rollback failure leaves the
// connection in an undefined state"). With a pool that costs one pooled
// connection; with a *pgx.Conn it is the Processor's only session, and
// every other partition (and every later assignment) is retried as
// "database unavailable" for good.
func TestPgxConnSurvivesARevocationThatCancelsAHandler(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	conn := oneConn(t)
	aStarted := make(chan struct{})
	p, err := consumer.New(conn, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if m.ID == "A" {
			close(aStarted)
			<-ctx.Done() // a slow handler that honours its context
			return ctx.Err()
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	wA := start(t, p, &memTransport{}, msg(0, "A", ""))
	<-aStarted
	stopCtx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	wA.Stop(stopCtx) // the revocation's grace ends: A's context is canceled, A returns
	trB := &memTransport{}
	wB := start(t, p, trB, msg(0, "B", ""))
	defer wB.Stop(ctx)
	deadline := time.Now().Add(5 * time.Second)
	for trB.lastMark() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the next partition's message not processed within 5s after a revocation canceled a handler (conn closed: %v)", conn.IsClosed())
		}
		time.Sleep(10 * time.Millisecond)
	}
}
