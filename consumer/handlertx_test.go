package consumer_test

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

// A handler that commits the Processor's transaction itself and then
// writes more through it lost that later write without a trace: the write
// failed with "tx is closed", the retry found the dedup record its own
// COMMIT had stored, and the message was marked done as a duplicate, with a
// Warn (helper 80: step-2 effects 0 of 2, 0 dead letters). Ending tx is the
// Processor's: such a message is dead-lettered at once, saying so, and
// logged at Error, in batch mode too.
func TestAHandlerThatWritesAfterCommittingTxItselfIsDeadLetteredSayingSo(t *testing.T) {
	inBothModes(t, func(t *testing.T, batch bool) {
		b := setup(t)
		logs := &syncBuffer{}
		c := &counter{}
		p := newLedgerProcessor(t, b.pool, batch, func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
			if err := b.record(ctx, tx, "ledger", m); err != nil {
				return err
			}
			if err := tx.Commit(ctx); err != nil {
				return err
			}
			return b.record(ctx, tx, "step2", m)
		}, &consumer.Config{Schema: b.schema, Hooks: []consumer.Hook{c}, Logger: slog.New(slog.NewTextHandler(logs, nil))})
		tr := &memTransport{}
		run(t, p, tr, msg(0, "id-0", ""), msg(1, "id-1", ""))
		dead := tr.deadLetters()
		if len(dead) != 2 || c.get(consumer.Duplicate) != 0 {
			t.Fatalf("%d dead letters, %d duplicates; want both messages dead-lettered, none taken for a duplicate", len(dead), c.get(consumer.Duplicate))
		}
		for _, d := range dead {
			if !strings.Contains(headerValue(d, "onceflow-error"), "after it ended") {
				t.Fatalf("dead letter's error %q does not say the handler used tx after it ended", headerValue(d, "onceflow-error"))
			}
		}
		if c.retries != 0 {
			t.Fatalf("%d retries, want none: running the handler again cannot mend it", c.retries)
		}
		if !strings.Contains(logs.String(), "level=ERROR") {
			t.Fatalf("nothing logged at Error:\n%s", logs.String())
		}
	})
}

// After a Rollback of the handler's own, nothing of the attempt committed,
// the dedup record included, so a retry is clean: a repository helper that
// rolls back on a serialization failure while its handler goes on is
// retried as before (its error says what happened), not dead-lettered at
// once (helper 83).
func TestAHandlerThatUsesTxAfterRollingItBackIsRetried(t *testing.T) {
	inBothModes(t, func(t *testing.T, batch bool) {
		b := setup(t)
		var runs atomic.Int64
		c := &counter{}
		p := newLedgerProcessor(t, b.pool, batch, func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
			if runs.Add(1) == 1 {
				_ = tx.Rollback(ctx)
			}
			return b.record(ctx, tx, "ledger", m)
		}, &consumer.Config{Schema: b.schema, Hooks: []consumer.Hook{c}, MinBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond})
		tr := &memTransport{}
		run(t, p, tr, msg(0, "id-0", ""))
		if d := tr.deadLetters(); len(d) != 0 {
			t.Fatalf("dead-lettered after a rollback whose retry is clean: %q", headerValue(d[0], "onceflow-error"))
		}
		if n := b.count(t, "message_id = 'id-0'"); n != 1 || c.get(consumer.Processed) != 1 {
			t.Fatalf("effects %d, processed %d; want the retry's one", n, c.get(consumer.Processed))
		}
	})
}

func headerValue(d consumer.DeadLetter, name string) string {
	for _, h := range d.Headers {
		if h.Key == name {
			return string(h.Value)
		}
	}
	return ""
}
