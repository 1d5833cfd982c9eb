package consumer_test

// Defects a cold review (helper 60) found; each test failed on the code
// before its fix.

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/consumer"
)

// A *pgx.Conn is one session. Two lanes (Concurrency 2, or two partitions)
// sharing it interleaved their transactions: B's BEGIN was a no-op inside
// A's transaction and B's COMMIT committed A's dedup record, so when A's
// handler then failed, its retry found the record and skipped A as a
// duplicate: A marked done with its handler never having succeeded.
func TestAPgxConnSharedByTwoLanesLosesNoMessage(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	conn := oneConn(t)
	var aRuns atomic.Int32
	p, err := consumer.New(conn, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if m.ID == "A" && aRuns.Add(1) == 1 {
			time.Sleep(300 * time.Millisecond) // B runs meanwhile, if it can
			return errors.New("transient failure, retry me")
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, Concurrency: 2, MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	w := start(t, p, tr, msg(0, "A", "a"), msg(1, "B", "b"))
	defer w.Stop(ctx)
	waitFor(t, 10*time.Second, "offset 1 marked done", func() bool { return tr.lastMark() == 1 })
	if a, bb := b.count(t, "message_id = 'A'"), b.count(t, "message_id = 'B'"); a != 1 || bb != 1 {
		t.Fatalf("effects: A %d, B %d (A's handler ran %d times, failing first); want one each", a, bb, aRuns.Load())
	}
}

// Offsets are committed after the transaction commits, so a crash leaves
// either nothing or the record. That holds only if COMMIT is durable when
// it returns: with synchronous_commit off (a common database or role
// default) a server crash just after COMMIT loses the effect and its dedup
// record while the offset is committed, and the message is never
// delivered again. The Processor's transactions commit synchronously.
func TestConsumerTransactionsCommitDurablyWhenTheSessionDefaultIsOff(t *testing.T) {
	b := setup(t)
	pool := ownPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["synchronous_commit"] = "off" })
	for _, plain := range []bool{false, true} {
		var seen atomic.Value
		handler := func(ctx context.Context, tx pgx.Tx) error {
			var s string
			if err := tx.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&s); err != nil {
				return err
			}
			seen.Store(s)
			return nil
		}
		p, err := consumer.New(pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
			return handler(ctx, tx)
		}, &consumer.Config{Schema: b.schema, PlainBegin: plain})
		if err != nil {
			t.Fatal(err)
		}
		run(t, p, &memTransport{}, msg(0, "pay-"+map[bool]string{false: "pooled", true: "plain"}[plain], "acct"))
		if s, _ := seen.Load().(string); s != "on" {
			t.Errorf("PlainBegin=%v: the message's transaction ran with synchronous_commit=%q, want on", plain, s)
		}
		seen.Store("")
		bp, err := consumer.NewBatch(pool, "ledger-batch", func(ctx context.Context, tx pgx.Tx, ms []consumer.Message) error {
			return handler(ctx, tx)
		}, &consumer.Config{Schema: b.schema, PlainBegin: plain})
		if err != nil {
			t.Fatal(err)
		}
		suffix := map[bool]string{false: "pooled", true: "plain"}[plain]
		run(t, bp, &memTransport{}, msg(0, "b1-"+suffix, "acct"), msg(1, "b2-"+suffix, "acct"))
		if s, _ := seen.Load().(string); s != "on" {
			t.Errorf("batch mode, PlainBegin=%v: the batch's transaction ran with synchronous_commit=%q, want on", plain, s)
		}
	}
	// A stronger setting is the user's and stays.
	strict := ownPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["synchronous_commit"] = "remote_apply" })
	var got string
	p, err := consumer.New(strict, "strict", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return tx.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&got)
	}, &consumer.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	run(t, p, &memTransport{}, msg(0, "s1", "acct"))
	if got != "remote_apply" {
		t.Errorf("a session with synchronous_commit=remote_apply ran the handler with %q, want it kept", got)
	}
}

// Stop says queued messages not yet started are not run. In batch mode,
// once a batch failed and its messages were retried one per transaction,
// Stop did not end that loop: each remaining message began a transaction
// and ran its handler after the revocation began, holding the rebalance
// up for as long as RevokeGrace allows.
func TestBatchFallbackStartsNoMessageAfterStop(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	started, release := make(chan struct{}), make(chan struct{})
	var afterStop atomic.Int32
	var stopped atomic.Bool
	p, err := consumer.NewBatch(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, ms []consumer.Message) error {
		if len(ms) > 1 {
			return errors.New("batch fails: retried one by one")
		}
		if ms[0].Offset == 0 {
			close(started)
			<-release
		} else if stopped.Load() {
			afterStop.Add(1)
		}
		return b.record(ctx, tx, "ledger", ms[0])
	}, &consumer.Config{Schema: b.schema, BatchSize: 10})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	w := p.StartPartition(ctx, tr)
	// All three queued before the worker takes the first: one batch.
	if n := w.TryAdd([]consumer.Message{msg(0, "m0", ""), msg(1, "m1", ""), msg(2, "m2", "")}); n != 3 {
		t.Fatalf("queued %d", n)
	}
	<-started
	stopCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	stopDone := make(chan struct{})
	stopped.Store(true)
	go func() { w.Stop(stopCtx); close(stopDone) }()
	time.Sleep(50 * time.Millisecond) // Stop has closed the partition
	close(release)
	<-stopDone
	if n := afterStop.Load(); n != 0 {
		t.Fatalf("%d messages not yet started when the partition was stopped were started afterwards", n)
	}
	// Nothing past the message that ran is marked done (offset 0 is, if
	// the worker took it before the others were queued, as a batch alone).
	if got := tr.lastMark(); got > 0 {
		t.Errorf("last offset marked done %d, want at most 0: messages 1 and 2 were not run", got)
	}
}
