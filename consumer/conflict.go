package consumer

import (
	"context"
	"errors"
	"log/slog"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5/pgconn"
)

// Conflicts. Under REPEATABLE READ or SERIALIZABLE (a role's or the
// pool's default_transaction_isolation, a handler's SET TRANSACTION), and
// with row locks taken in different orders at any level, PostgreSQL rolls
// back some transactions of valid messages with a serialization failure
// (SQLSTATE 40001) or a deadlock (40P01), from a statement or from COMMIT,
// and documents the answer: retry the transaction. Such an attempt spends
// Config.MaxConflicts, not MaxAttempts, so load on a hot row does not
// dead-letter good messages; a batch is retried whole, not split. Lock
// timeouts (55P03) and statement timeouts (57014) stay handler failures:
// they bound waits the user chose to bound, a stuck lock holder would
// otherwise hold the partition for good, and 57014 is also what a
// cancel request (pg_cancel_backend, Stop abandoning a handler) reports.

// SQLSTATEs PostgreSQL answers with "retry the transaction".
const (
	serializationFailure = "40001"
	deadlockDetected     = "40P01"
)

// isConflict reports whether err is a serialization failure or a deadlock.
func isConflict(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == serializationFailure || pgErr.Code == deadlockDetected)
}

// retryConflict reports whether a failed attempt whose error is err is
// retried as a conflict: err is one, the handler did not mark it
// Permanent, and *spent is below Config.MaxConflicts, which it then
// counts. Past the budget a conflict is a handler failure like any other,
// so a message that conflicts for good is still dead-lettered (G6).
func (p *Processor) retryConflict(err error, spent *int) bool {
	if IsPermanent(err) || !isConflict(err) || *spent >= p.cfg.MaxConflicts {
		return false
	}
	*spent++
	return true
}

// retryingConflicts is the Warn logged for a conflict retried.
const retryingConflicts = "consumer: transaction rolled back for a serialization failure or deadlock; retrying"

// attemptBatchRetrying is attemptBatch, run again whole, after a backoff,
// while it fails with a conflict within Config.MaxConflicts: split into
// per-message transactions, a batch that only met a conflict would cost a
// transaction per message and spend their MaxAttempts.
func (p *Processor) attemptBatchRetrying(ctx context.Context, stop <-chan struct{}, msgs []Message) error {
	var bo backoff.BackOff
	conflicts := 0
	for {
		err := p.attemptBatch(ctx, stop, msgs)
		if err == nil || ctx.Err() != nil || !p.retryConflict(err, &conflicts) {
			return err
		}
		if bo == nil {
			bo = p.newBackoff()
		}
		if !p.retryAfter(ctx, stop, msgs[0], bo, conflicts, err, retryingConflicts, slog.Int("batch_size", len(msgs)),
			slog.Int("conflicts", conflicts), slog.Int("max_conflicts", p.cfg.MaxConflicts)) {
			return errAbandoned
		}
	}
}
