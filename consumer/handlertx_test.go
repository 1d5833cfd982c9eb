package consumer_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

// A handler that commits the Processor's transaction itself and then
// writes more through it lost that later write without a trace: the write
// failed with "tx is closed", the retry found the dedup record its own
// COMMIT had stored, and the message was marked done as a duplicate, with a
// Warn (helper 80: step-2 effects 0 of 2, 0 dead letters). Ending tx is the
// Processor's; a handler that uses tx after ending it is dead-lettered at
// once, saying so, and logged at Error.
func TestAHandlerThatUsesTxAfterEndingItIsDeadLetteredSayingSo(t *testing.T) {
	for _, tc := range []struct {
		end   string
		batch bool
	}{{"commit", false}, {"rollback", false}, {"commit", true}, {"rollback", true}} {
		end := tc.end
		name := end
		if tc.batch {
			name += "/batch"
		}
		t.Run(name, func(t *testing.T) {
			b := setup(t)
			logs := &syncBuffer{}
			c := &counter{}
			p := newLedgerProcessor(t, b.pool, tc.batch, func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
				if err := b.record(ctx, tx, "ledger", m); err != nil {
					return err
				}
				var err error
				if end == "commit" {
					err = tx.Commit(ctx)
				} else {
					err = tx.Rollback(ctx)
				}
				if err != nil {
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
}

func headerValue(d consumer.DeadLetter, name string) string {
	for _, h := range d.Headers {
		if h.Key == name {
			return string(h.Value)
		}
	}
	return ""
}
