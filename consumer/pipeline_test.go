package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/consumer"
)

// seatTaken creates a table whose one seat is taken, under a deferred
// unique constraint, and returns a handler step that takes it again: the
// step succeeds, and the transaction's COMMIT fails.
func (b *bundle) seatTaken(t *testing.T) func(context.Context, pgx.Tx) error {
	t.Helper()
	seats := pgx.Identifier{b.schema, "seats"}.Sanitize()
	if _, err := b.pool.Exec(context.Background(), `CREATE TABLE `+seats+` (seat int UNIQUE DEFERRABLE INITIALLY DEFERRED);
INSERT INTO `+seats+` VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	return func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+seats+` VALUES (1)`)
		return err
	}
}

// pipelineTracer counts the queries that COMMIT one message and BEGIN the
// next in one round trip.
type pipelineTracer struct{ pipelined atomic.Int32 }

func (pt *pipelineTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(d.SQL, "COMMIT; BEGIN;") {
		pt.pipelined.Add(1)
	}
	return ctx
}

func (pt *pipelineTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// tracedPool returns a pool of the test's own whose queries tracer sees.
func tracedPool(t *testing.T, tracer pgx.QueryTracer) *pgxpool.Pool {
	t.Helper()
	return ownPool(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = tracer })
}

// Messages queued behind one another are committed in pipeline (each
// COMMIT carries the next message's BEGIN and dedup insert), in order and
// key-parallel mode alike, with every effect exactly once, duplicates
// (which fail the pipelined dedup insert) included.
func TestPipelinedCommitsKeepEffectsExactlyOnce(t *testing.T) {
	for _, concurrency := range []int{1, 4} {
		t.Run(fmt.Sprintf("concurrency %d", concurrency), func(t *testing.T) {
			b := setup(t)
			tracer := &pipelineTracer{}
			pool := tracedPool(t, tracer)
			p, err := consumer.New(pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
				return b.record(ctx, tx, "ledger", m)
			}, &consumer.Config{Schema: b.schema, Concurrency: concurrency})
			if err != nil {
				t.Fatal(err)
			}
			var msgs []consumer.Message
			for i := range 60 {
				id := fmt.Sprintf("id-%d", i)
				if i%5 == 4 {
					id = fmt.Sprintf("id-%d", i-1) // a redelivery right behind the first
				}
				msgs = append(msgs, msg(int64(i), id, fmt.Sprintf("k%d", i%7)))
			}
			run(t, p, &memTransport{}, msgs...)

			for i := range 60 {
				want := 1
				if i%5 == 4 {
					want = 0
				} else if i%5 == 3 {
					want = 1 // processed once though delivered twice
				}
				if got := b.count(t, "message_id = $1", fmt.Sprintf("id-%d", i)); got != want {
					t.Errorf("effects of id-%d = %d, want %d", i, got, want)
				}
			}
			if tracer.pipelined.Load() == 0 {
				t.Fatal("no COMMIT carried the next message's BEGIN: the test exercised nothing")
			}
			if n := pool.Stat().AcquiredConns(); n != 0 {
				t.Errorf("connections still held after the partition stopped: %d", n)
			}
		})
	}
}

// A COMMIT that fails (here a deferred unique constraint) in a pipelined
// round trip fails only its own message: the server skips the next
// message's BEGIN, and that message runs afresh. The unique violation must
// not be mistaken for the next message being a duplicate.
func TestFailedPipelinedCommitRetriesItsMessageAndKeepsTheNext(t *testing.T) {
	b := setup(t)
	tracer := &pipelineTracer{}
	pool := tracedPool(t, tracer)
	takeSeat := b.seatTaken(t)
	p, err := consumer.New(pool, "booking", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if string(m.Key) == "taken" {
			if err := takeSeat(ctx, tx); err != nil {
				return err
			}
		}
		return b.record(ctx, tx, "booking", m)
	}, &consumer.Config{Schema: b.schema, MaxAttempts: 2, MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	run(t, p, tr, msg(0, "a", "free"), msg(1, "b", "taken"), msg(2, "c", "free"), msg(3, "d", "free"))

	for id, want := range map[string]int{"a": 1, "b": 0, "c": 1, "d": 1} {
		if got := b.count(t, "message_id = $1", id); got != want {
			t.Errorf("effects of %s = %d, want %d", id, got, want)
		}
	}
	if got := b.processedRows(t, "booking"); got != 3 {
		t.Errorf("dedup rows = %d, want 3 (b's rolled back with its COMMIT)", got)
	}
	dead := tr.deadLetters()
	if len(dead) != 1 || string(dead[0].Value) != "v1" {
		t.Fatalf("dead letters = %+v, want the message at offset 1 only", dead)
	}
	if tracer.pipelined.Load() == 0 {
		t.Fatal("no COMMIT carried the next message's BEGIN: the test exercised nothing")
	}
}

// blockingTransport holds MarkDone of one offset until released.
type blockingTransport struct {
	memTransport
	at       int64
	entered  chan struct{}
	released chan struct{}
}

func (bt *blockingTransport) MarkDone(m consumer.Message) {
	bt.memTransport.MarkDone(m)
	if m.Offset == bt.at {
		close(bt.entered)
		<-bt.released
	}
}

// A worker stopped while it holds the next message's transaction (begun
// with the previous COMMIT, its handler not yet run) rolls it back: no
// dedup record, no effect, no mark, no connection kept.
func TestStopRollsBackACarriedTransaction(t *testing.T) {
	b := setup(t)
	tracer := &pipelineTracer{}
	pool := tracedPool(t, tracer)
	var ran atomic.Int32
	p, err := consumer.New(pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		ran.Add(1)
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	tr := &blockingTransport{at: 0, entered: make(chan struct{}), released: make(chan struct{})}
	ctx := context.Background()
	w := start(t, p, tr, msg(0, "m0", ""), msg(1, "m1", ""))
	<-tr.entered // m0 committed, with m1's BEGIN in the same round trip
	stopped := make(chan struct{})
	go func() { w.Stop(ctx); close(stopped) }()
	for !errors.Is(w.Add(ctx, msg(9, "m9", "")), consumer.ErrStopped) {
		// Add fails once Stop has begun.
	}
	close(tr.released)
	<-stopped

	if tracer.pipelined.Load() != 1 {
		t.Fatalf("pipelined commits = %d, want 1: m1's BEGIN should have gone with m0's COMMIT", tracer.pipelined.Load())
	}
	if got := ran.Load(); got != 1 {
		t.Errorf("handler runs = %d, want 1 (m0 only)", got)
	}
	if got := b.processedRows(t, "ledger"); got != 1 {
		t.Errorf("dedup rows = %d, want 1: m1's carried transaction must roll back", got)
	}
	if got := tr.lastMark(); got != 0 {
		t.Errorf("last mark = %d, want 0", got)
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("connections still held after Stop: %d", n)
	}
}

// dlqProbe runs check when a dead letter is published.
type dlqProbe struct {
	memTransport
	check func()
}

func (d *dlqProbe) PublishDeadLetter(ctx context.Context, dl consumer.DeadLetter) error {
	d.check()
	return d.memTransport.PublishDeadLetter(ctx, dl)
}

// In key-parallel mode a lane takes the next ready message to pipeline it
// with its COMMIT. If that COMMIT fails, the message goes back to whichever
// lane is free, rather than wait out the failed message's retries.
func TestFailedCommitHandsTheTakenMessageBack(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	takeSeat := b.seatTaken(t)
	p, err := consumer.New(b.pool, "booking", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		switch string(m.Key) {
		case "slow":
			time.Sleep(200 * time.Millisecond) // keeps the other lane busy while "bad" commits
		case "bad":
			if err := takeSeat(ctx, tx); err != nil {
				return err
			}
		}
		return b.record(ctx, tx, "booking", m)
	}, &consumer.Config{Schema: b.schema, Concurrency: 2, MaxAttempts: 2, MinBackoff: 2 * time.Second, MaxBackoff: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	goodDoneFirst := make(chan bool, 1)
	tr := &dlqProbe{check: func() { goodDoneFirst <- b.count(t, "message_id = 'good'") == 1 }}
	defer start(t, p, tr, msg(0, "slow", "slow"), msg(1, "bad", "bad"), msg(2, "good", "good")).Stop(ctx)
	waitFor(t, 30*time.Second, "offset 2 marked done", func() bool { return tr.lastMark() == 2 })
	if !<-goodDoneFirst {
		t.Fatal(`"good" was processed only after "bad" was dead-lettered: it waited behind bad's retries`)
	}
}

// A handler that ignores a failed statement leaves its transaction aborted;
// its COMMIT then rolls back. That is the message failing, not the
// database: it spends the retry budget and is dead-lettered, rather than
// block the partition as an endless "database unavailable".
func TestHandlerIgnoringAFailedStatementIsDeadLettered(t *testing.T) {
	b := setup(t)
	p, err := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if string(m.Key) == "careless" {
			_, _ = tx.Exec(ctx, `SELECT 1/0`)
			return nil
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, MaxAttempts: 2, MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	run(t, p, tr, msg(0, "a", "fine"), msg(1, "b", "careless"), msg(2, "c", "fine"))
	dead := tr.deadLetters()
	if len(dead) != 1 || string(dead[0].Value) != "v1" {
		t.Fatalf("dead letters = %+v, want the message at offset 1", dead)
	}
	if got := b.count(t, ""); got != 2 {
		t.Errorf("effects = %d, want 2 (a and c)", got)
	}
}

// In key-parallel mode, when a lane has taken another key's message to
// pipeline with its COMMIT, the next message of the key it just finished
// goes to whichever lane is free, rather than wait behind the taken
// message's retries.
func TestKeysNextMessageDoesNotWaitBehindATakenMessage(t *testing.T) {
	b := setup(t)
	p, err := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		switch string(m.Key) {
		case "slow":
			time.Sleep(300 * time.Millisecond) // keeps the other lane busy
		case "bad":
			return errors.New("always fails")
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, Concurrency: 2, MaxAttempts: 2, MinBackoff: 3 * time.Second, MaxBackoff: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	a2DoneFirst := make(chan bool, 1)
	tr := &dlqProbe{check: func() { a2DoneFirst <- b.count(t, "message_id = 'a2'") == 1 }}
	ctx := context.Background()
	defer start(t, p, tr, msg(0, "s", "slow"), msg(1, "a1", "A"), msg(2, "bad", "bad"), msg(3, "a2", "A")).Stop(ctx)
	waitFor(t, 30*time.Second, "offset 3 marked done", func() bool { return tr.lastMark() == 3 })
	if !<-a2DoneFirst {
		t.Fatal(`a2 was processed only after "bad" was dead-lettered: it waited behind bad's retries`)
	}
}
