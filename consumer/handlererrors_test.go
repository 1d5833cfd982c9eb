package consumer_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/consumer"
)

// validationError's Error reads its receiver: a nil *validationError
// returned as error (the typed-nil mistake) panics when its text is read.
type validationError struct{ field string }

func (e *validationError) Error() string { return "invalid " + e.field }

// helper 120: the handler's error is read outside the handler's recover
// (its text for the dead letter's header, its classification). A typed
// nil whose Error panics crashed the consumer when the message was
// dead-lettered, and again on every redelivery: the partition, and the
// process, stopped for good (G6). It is dead-lettered like any failing
// message, and the partition goes on.
func TestAHandlerErrorWhoseMethodsPanicIsDeadLettered(t *testing.T) {
	inBothModes(t, func(t *testing.T, batch bool) {
		b := setup(t)
		p := newLedgerProcessor(t, b.pool, batch, func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
			if string(m.Value) == "v0" {
				var err *validationError
				return err // a nil *validationError: not a nil error
			}
			return b.record(ctx, tx, "ledger", m)
		}, &consumer.Config{Schema: b.schema, MaxAttempts: 2})
		tr := &memTransport{}
		run(t, p, tr, msg(0, "m-typed-nil", "k"), msg(1, "m-next", "k"))
		dead := tr.deadLetters()
		if len(dead) != 1 || !strings.Contains(string(dead[0].Err.Error()), "validationError") {
			t.Fatalf("dead letters %v, want one naming the error's type", dead)
		}
		if n := b.count(t, "message_id = 'm-next'"); n != 1 {
			t.Fatalf("the next message's effect: %d rows, want 1", n)
		}
	})
}

// helper 120: a handler that ends its transaction with SQL of its own
// (tx.Exec("ROLLBACK"), to "clean up" after an error) and then writes on
// writes outside any transaction: each statement commits alone, without the
// dedup record. The Processor saw the handler return nil, sent COMMIT (a
// warning, no error) and counted the message processed, and a redelivery
// ran the effects again (G5) with nothing said. The handler's ending of tx
// is refused as when it calls tx.Rollback itself: retried, then
// dead-lettered with the reason.
func TestAHandlerThatEndsItsTransactionWithSQLIsRefused(t *testing.T) {
	inBothModes(t, func(t *testing.T, batch bool) {
		b := setup(t)
		p := newLedgerProcessor(t, b.pool, batch, func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
			if _, err := tx.Exec(ctx, "ROLLBACK"); err != nil {
				return err
			}
			return b.record(ctx, tx, "ledger", m)
		}, &consumer.Config{Schema: b.schema, MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond})
		tr := &memTransport{}
		run(t, p, tr, msg(0, "m-raw-rollback", "k"))
		dead := tr.deadLetters()
		if len(dead) != 1 || !strings.Contains(dead[0].Err.Error(), "ended its transaction") {
			t.Fatalf("dead letters %v; want the message dead-lettered as one whose handler ended its transaction, not counted processed", dead)
		}
		// helper 122: what it wrote after its ROLLBACK committed on its
		// own; retrying wrote it again, once per attempt (5 by default).
		// Dead-lettered at once, it is written by the one run (and, in
		// batch mode, the batch's run before it).
		want := 1
		if batch {
			want = 2
		}
		if n := b.count(t, "message_id = 'm-raw-rollback'"); n > want {
			t.Fatalf("the effect written after the handler's ROLLBACK was written %d times, want at most %d: it was retried", n, want)
		}
	})
}

// helper 122: a handler's error wrapping a nil *pgconn.PgError (the wrong
// variable returned after errors.As) passed usableError (its text reads
// fine) and panicked where the Processor classifies it (isConflict reads
// its Code), outside the handler's recover: the partition stopped on every
// redelivery.
func TestAHandlerErrorWrappingANilPgErrorIsDeadLettered(t *testing.T) {
	inBothModes(t, func(t *testing.T, batch bool) {
		b := setup(t)
		p := newLedgerProcessor(t, b.pool, batch, func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
			if string(m.Value) == "v0" {
				var pgErr *pgconn.PgError
				return fmt.Errorf("charge: %w", pgErr)
			}
			return b.record(ctx, tx, "ledger", m)
		}, &consumer.Config{Schema: b.schema, MaxAttempts: 2, MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond})
		tr := &memTransport{}
		run(t, p, tr, msg(0, "m-nil-pgerror", "k"), msg(1, "m-next", "k"))
		if dead := tr.deadLetters(); len(dead) != 1 {
			t.Fatalf("dead letters %v, want one", dead)
		}
		if n := b.count(t, "message_id = 'm-next'"); n != 1 {
			t.Fatalf("the next message's effect: %d rows, want 1", n)
		}
	})
}
