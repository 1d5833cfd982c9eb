package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/migrations"
)

// ErrPreparedStatementsLost is returned by Run (wrapping the database error
// that showed it) when the pool talks to a pooler whose server connections
// do not keep the statements pgx prepared on them: in transaction mode it
// lends each transaction whichever server connection is free. The relay
// cannot work there: a round published and then not recorded is published
// again, and most statements fail.
var ErrPreparedStatementsLost = errors.New("relay: the database connections lose their prepared statements between transactions (SQLSTATE 26000 or 42P05): " +
	"a pooler in transaction mode (PgBouncer before 1.21, or without max_prepared_statements) lends each transaction another server connection; " +
	"add default_query_exec_mode=exec to the database URL, or pool in session mode")

// ErrInsufficientPrivilege is returned by Run (wrapping the database error,
// which names the table, sequence or function) when the relay's role lacks
// a privilege it needs (SQLSTATE 42501; README, "Roles and privileges"). A
// relay without it cannot work, and retrying does not mend a grant: without
// DELETE on the outbox it published the same events round after round,
// without a grant at start it owned no shard while reporting itself ready,
// and without SELECT on the outbox's sequence it fell back to polling,
// silently ten times slower. It is also returned when row-level security
// applies to the relay's role on its tables, at start or at a lease tick.
var ErrInsufficientPrivilege = errors.New("relay: the database role lacks a privilege the relay needs (README, \"Roles and privileges\")")

// isInsufficientPrivilege reports whether err is a permission refusal.
func isInsufficientPrivilege(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42501"
}

// isStatementLoss reports whether err says a prepared statement is missing
// on the server connection (26000), or already there (42P05).
func isStatementLoss(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "26000" || pgErr.Code == "42P05")
}

// lostStatements returns ErrPreparedStatementsLost wrapping err.
func lostStatements(err error) error {
	return fmt.Errorf("%w (the last: %w)", ErrPreparedStatementsLost, err)
}

// statementLoss decides whether a lost statement means a pooler in
// transaction mode. A statement can be lost on a connection of its own
// too, once: another user of a shared pool ran DISCARD ALL or DEALLOCATE
// ALL on it, and pgx prepares it again; every statement cached on that
// connection fails once, so counting errors cannot tell the two apart. A
// pooler can: it makes up the process id a connection's start-up announces
// (it has to route cancel requests itself), so that id differs from the
// server's pg_backend_pid(). Behind one, a lost statement stops the relay;
// without one, it is logged and the relay goes on. Safe for concurrent
// use.
type statementLoss struct {
	mu      sync.Mutex
	known   bool // pooled is known
	pooled  bool
	stopped bool // the run was stopped for it
}

// check returns the error Run should stop with for err, or nil; the first
// time it meets a lost statement it asks the database whether the pool
// talks to a pooler (a failed question is asked again next time).
func (l *statementLoss) check(pool *pgxpool.Pool, err error) error {
	if !isStatementLoss(err) {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.known {
		pooled, qErr := behindPooler(pool)
		if qErr != nil {
			return nil
		}
		l.known, l.pooled = true, pooled
	}
	if !l.pooled {
		return nil
	}
	return lostStatements(err)
}

// behindPooler reports whether pool's connections talk to a pooler rather
// than to PostgreSQL: the server's process id differs from the one the
// connection's start-up announced. Asked by the simple protocol, which
// prepares nothing.
func behindPooler(pool *pgxpool.Pool) (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := pool.Acquire(ctx)
	if err != nil {
		return false, err
	}
	defer c.Release()
	var pid int64
	if err := c.Conn().QueryRow(ctx, `SELECT pg_backend_pid()`, pgx.QueryExecModeSimpleProtocol).Scan(&pid); err != nil {
		return false, err
	}
	return pid != int64(c.Conn().PgConn().PID()), nil
}

// noteDBError stops the run if err is a lost statement behind a pooler
// (statementLoss), and logs one without. Called where the relay logs a
// database error and goes on.
func (r *Relay) noteDBError(err error) {
	stop := r.stmtLoss.check(r.pool, err)
	switch {
	case isInsufficientPrivilege(err):
		if r.privilegeStop.CompareAndSwap(false, true) {
			r.log.Error("relay: stopping: the database role lacks a privilege the relay needs", "error", err)
			r.stopRun(fmt.Errorf("%w: %w", ErrInsufficientPrivilege, err))
		}
	case stop != nil:
		r.stmtLoss.mu.Lock()
		first := !r.stmtLoss.stopped
		r.stmtLoss.stopped = true
		r.stmtLoss.mu.Unlock()
		if first {
			r.log.Error("relay: stopping: the pooler's server connections do not keep the prepared statements", "error", stop)
			r.stopRun(stop)
		}
	case isStatementLoss(err):
		r.log.Warn("relay: a prepared statement was missing on its connection (did another user of the pool run DISCARD ALL or DEALLOCATE?); prepared again", "error", err)
	case isSchemaError(err):
		r.recheckSchema()
	}
}

// isReadOnly reports whether err says the database refused a write as
// read-only: a standby the pool reconnected to after a failover, or
// default_transaction_read_only.
func isReadOnly(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "25006" // read_only_sql_transaction
}

// isSchemaError reports whether err says a table, column, schema or
// function is missing: the schema changed under the relay (migrated down,
// dropped), not a database away.
func isSchemaError(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code {
	case "42P01", "42703", "3F000", "42883": // undefined table, column, schema, function
		return true
	}
	return false
}

// recheckSchema stops the run, as its start would have, if the schema now
// lacks a migration this relay needs: every statement would fail for good
// while the probes said ready.
func (r *Relay) recheckSchema() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := migrations.Check(ctx, r.pool, r.cfg.Schema)
	var missing *migrations.MissingError
	if !errors.As(err, &missing) {
		return
	}
	r.log.Error("relay: stopping: the schema was changed under the running relay", "error", err)
	r.stopRun(fmt.Errorf("relay: the schema changed while the relay ran: %w", err))
}
