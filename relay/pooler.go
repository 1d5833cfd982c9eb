package relay

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// ErrPreparedStatementsLost is returned by Run (wrapping the last such
// database error) when the server connections behind the pool do not keep
// the statements pgx prepared on them: a pooler in transaction mode lends
// each transaction whichever server connection is free. The relay cannot
// work there: a round published and then not recorded is published again,
// and most statements fail.
var ErrPreparedStatementsLost = errors.New("relay: the database connections lose their prepared statements between transactions (SQLSTATE 26000 or 42P05): " +
	"a pooler in transaction mode (PgBouncer before 1.21, or without max_prepared_statements) lends each transaction another server connection; " +
	"add default_query_exec_mode=exec to the database URL, or pool in session mode")

// statementLossLimit errors within statementLossWindow stop the relay. One
// alone does not: pgx's statement cache has had bugs of its own that
// raised them once (jackc/pgx#1847); behind a pooler in transaction mode
// they come many times a second.
const (
	statementLossLimit  = 3
	statementLossWindow = time.Minute
)

// isStatementLoss reports whether err says a prepared statement is missing
// on the server connection (26000), or already there (42P05).
func isStatementLoss(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "26000" || pgErr.Code == "42P05")
}

// statementLoss counts isStatementLoss errors. Safe for concurrent use.
type statementLoss struct {
	mu   sync.Mutex
	seen []time.Time // within the window, oldest first
}

// note records err and returns the error Run should stop with, or nil.
func (l *statementLoss) note(err error, now time.Time) error {
	if !isStatementLoss(err) {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for len(l.seen) > 0 && now.Sub(l.seen[0]) > statementLossWindow {
		l.seen = l.seen[1:]
	}
	if l.seen = append(l.seen, now); len(l.seen) < statementLossLimit {
		return nil
	}
	return lostStatements(err)
}

// lostStatements returns ErrPreparedStatementsLost wrapping err, the last
// such database error.
func lostStatements(err error) error {
	return fmt.Errorf("%w (the last: %w)", ErrPreparedStatementsLost, err)
}

// noteDBError stops the run if err is the last straw of isStatementLoss
// errors. Called where the relay logs a database error and goes on.
func (r *Relay) noteDBError(err error) {
	if stop := r.stmtLoss.note(err, time.Now()); stop != nil {
		r.log.Error("relay: stopping: the server connections do not keep the prepared statements", "error", stop)
		r.stopRun(stop)
	}
}
