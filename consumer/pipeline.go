package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Pipelined commits: when a worker (an in-order partition, or a lane in
// key-parallel mode) already has its next message at hand as it commits a
// message, it sends
//
//	COMMIT; BEGIN; EXECUTE dedup_insert(consumer, next_id)
//
// as one simple-protocol query on the same connection. A message then costs
// two round trips plus the handler's own (dedup insert with BEGIN, COMMIT
// with the next one's dedup insert), not three. Ordering and crash safety
// are unchanged: the server runs the statements in order, the message is
// marked done only once its COMMIT succeeded, and the next message's
// handler runs only after its dedup record is in.

// lookahead is a worker's view of the message it will run next.
type lookahead struct {
	// next returns the message the worker will run next, if one is at
	// hand without waiting; the worker must run that message next.
	next func() (Message, bool)
	// putBack, if set, hands back the message next took when the COMMIT
	// it was to ride with failed, so that a message of another key does
	// not wait out this message's retries.
	putBack func()
	// carry is next's transaction, begun by the previous COMMIT's round
	// trip.
	carry *carried
	// turn is the worker's run on its connection (see keepConnection).
	turn turn
}

// carried is a transaction begun, with its dedup record inserted, for the
// message at offset.
type carried struct {
	offset  int64
	tx      pgx.Tx
	release func()
}

// take returns the carried transaction if it is msg's.
func (la *lookahead) take(msg Message) *carried {
	if la == nil {
		return nil
	}
	if la.carry == nil {
		la.turn.begun() // msg begins on a connection of its own
		return nil
	}
	c := la.carry
	la.carry = nil
	if c.offset != msg.Offset {
		c.discard() // not reached: a worker runs the message it announced
		return nil
	}
	return c
}

// giveBack undoes next after a failed COMMIT, where the worker can.
func (la *lookahead) giveBack() {
	if la != nil && la.putBack != nil {
		la.putBack()
	}
}

// discard rolls back a carried transaction the worker will not run (it
// stopped); the message stays unmarked and is delivered again.
func (la *lookahead) discard() {
	if la != nil && la.carry != nil {
		la.carry.discard()
		la.carry = nil
	}
}

func (c *carried) discard() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = c.tx.Rollback(ctx)
	c.release() // the pool closes the connection if the rollback failed
}

// commit commits msg's transaction. With a pooled connection and the
// worker's next message at hand, it begins that message's transaction in
// the same round trip and hands it to la, taking over *release (the
// connection goes with it). A nil error means msg is committed.
func (p *Processor) commit(ctx context.Context, tx pgx.Tx, msg Message, la *lookahead, release *func()) error {
	next, nextID, ok := p.pipelinable(tx, la)
	if !ok {
		if err := tx.Commit(ctx); err != nil {
			la.giveBack()
			return p.commitError(tx, msg, err)
		}
		return nil
	}
	conn := tx.Conn()
	ntx, err := conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: "COMMIT; " + p.beginInsert + literal(nextID) + ")"})
	if err == nil {
		la.carry = &carried{offset: next.Offset, tx: ntx, release: *release}
		*release = func() {}
		return nil
	}
	var pgErr *pgconn.PgError
	isPgErr := errors.As(err, &pgErr)
	switch status := conn.PgConn().TxStatus(); {
	case isPgErr && !conn.IsClosed() && status == 'E':
		// COMMIT and BEGIN went through and the next message's dedup
		// insert failed (a duplicate, most likely, or the statement is
		// not on this server session: see lostStatement): msg is
		// committed; the next message begins afresh when its turn comes.
		_, _ = conn.Exec(ctx, "ROLLBACK")
		p.lostStatement(ctx, err)
		return nil
	case isPgErr && !conn.IsClosed() && status == 'I':
		// The COMMIT failed and the server skipped the rest.
		la.giveBack()
		return p.commitError(tx, msg, err)
	default:
		// The connection broke: the COMMIT may or may not have
		// happened, and the retry will tell (the dedup record).
		la.giveBack()
		return &lostError{err: fmt.Errorf("consumer %s: commit message %s: %w", p.name, msg.ID, err), atCommit: true}
	}
}

// pipelinable returns the worker's next message and its id when msg's
// COMMIT can carry that message's BEGIN and dedup insert.
func (p *Processor) pipelinable(tx pgx.Tx, la *lookahead) (Message, string, bool) {
	if la == nil || la.next == nil || la.carry != nil {
		return Message{}, "", false
	}
	if _, pooled := p.db.(acquirer); !pooled || p.plainBegin() {
		return Message{}, "", false // the statement is prepared on pooled connections only
	}
	// An aborted transaction's COMMIT rolls back without an error; only
	// tx.Commit reports that (pgx.ErrTxCommitRollback).
	if tx.Conn().PgConn().TxStatus() != 'T' {
		return Message{}, "", false
	}
	if !p.keepConnection(la) {
		return Message{}, "", false // the pool's other users get their turn
	}
	next, ok := la.next()
	if !ok || next.skip {
		return Message{}, "", false
	}
	id, err := p.messageID(next)
	if err != nil {
		return Message{}, "", false
	}
	if !isASCII(id) {
		// PostgreSQL converts a query to the database's encoding as it
		// receives it: an id the database cannot hold would make it
		// refuse the whole query before running its COMMIT, and abort
		// the transaction commit would take for committed. The message
		// begins by itself instead (see refusedForMessage).
		return Message{}, "", false
	}
	return next, id, true
}

// commitError classifies a failed COMMIT of msg's transaction tx.
func (p *Processor) commitError(tx pgx.Tx, msg Message, err error) error {
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, pgx.ErrTxCommitRollback):
		// A statement had failed and the handler went on: the message
		// failed, and spends its retry budget like any handler error.
		return fmt.Errorf("consumer %s: message %s: the transaction had failed (did the handler ignore an error?) and was rolled back at commit: %w", p.name, msg.ID, err)
	case tx.Conn().IsClosed() || !errors.As(err, &pgErr):
		// The connection broke (a FATAL error closes it too): the
		// commit may or may not have happened. The retry will tell (the
		// dedup record), and no message is dead-lettered before it did
		// (see runOne). It spends the lost-connection budget: a session
		// the server ended for the transaction's own doing (it idled
		// past idle_in_transaction_session_timeout) fails every COMMIT,
		// and must not hold the partition forever.
		return &lostError{err: fmt.Errorf("consumer %s: commit message %s: %w", p.name, msg.ID, err), atCommit: true}
	default:
		return fmt.Errorf("consumer %s: commit message %s: %w", p.name, msg.ID, err)
	}
}
