package consumer

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"log/slog"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Handler processes one message. Everything it writes through tx commits
// together with the message's dedup record, so those effects happen at most
// once per (consumer name, message id). Return Permanent(err) for failures
// that retrying cannot fix. The Processor ends tx: a handler must not
// Commit or Roll it back (savepoints, tx.Begin, are fine). One that
// commits tx and then uses it is dead-lettered at once, saying so (what it
// wrote after is lost, and a retry would find the message recorded); one
// that rolls it back and then uses it fails that attempt, and is retried.
//
// ctx is canceled when the consumer abandons the message (shutdown, lost
// partition); the transaction then rolls back and the message is processed
// again later. A Handler must be safe for concurrent use when several
// partitions (or Config.Concurrency > 1) are processed at once.
type Handler func(ctx context.Context, tx pgx.Tx, msg Message) error

// BatchHandler processes the new messages of a batch, in offset order, in
// one transaction; messages already processed are left out. The whole batch
// commits or none of it does. As for Handler, ending tx is the Processor's.
type BatchHandler func(ctx context.Context, tx pgx.Tx, msgs []Message) error

// Beginner starts transactions: *pgxpool.Pool fits, and is what to use. A
// *pgx.Conn (or a *pgxpool.Conn) fits too: it is one session, not safe for
// concurrent use, so the Processor then runs one transaction at a time on
// it, whatever Concurrency and however many partitions (two interleaved on
// one session would be one transaction, and one's COMMIT would commit the
// other's dedup record). Nor is it reopened once closed (a database
// restart; Stop abandoning a handler that ignores its context, which closes
// that handler's connection): the Processor then waits for the database
// for good. The one-at-a-time rule is the Processor's: two Processors (or
// a Processor and a Janitor) must not share a connection.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Processor is the transport-agnostic core: it runs messages through the
// dedup record, the handler, retries and the dead-letter topic. Adapters
// (kgoconsumer, kafkagoconsumer) feed it Kafka records through Partition.
// A Processor is safe for concurrent use and holds no connection.
type Processor struct {
	db        Beginner
	name      string
	handler   Handler
	batch     BatchHandler
	cfg       Config
	hooks     hooks
	log       *slog.Logger
	insertOne string
	insertAll string
	// stmtName is the connection-level prepared statement of the strict
	// insert, and beginInsert BEGIN plus its EXECUTE up to the message id
	// literal; see begin.
	stmtName    string
	strictOne   string
	beginInsert string
	// unprepared is set once the dedup statement was found missing on,
	// or already prepared on, the server (see lostStatement).
	unprepared atomic.Bool
	// oneSession is a one-slot semaphore when db is a single connection
	// (*pgx.Conn, *pgxpool.Conn): a transaction holds it from BEGIN to its
	// end. Nil for a pool.
	oneSession chan struct{}
	// running holds, per partition (its stop channel), the connections of
	// the handlers running, so that Stop can close those it abandons.
	runningMu sync.Mutex
	running   map[<-chan struct{}]map[*pgconn.PgConn]struct{}
}

// New returns a Processor in per-message mode: one transaction per message.
// name scopes deduplication: two consumers with different names both
// process every message. cfg may be nil.
func New(db Beginner, name string, h Handler, cfg *Config) (*Processor, error) {
	if h == nil {
		return nil, errors.New("consumer: handler is nil")
	}
	return newProcessor(db, name, h, nil, cfg)
}

// NewBatch returns a Processor in batch mode: one transaction and one
// multi-row dedup insert per batch of buffered messages of a partition, the
// throughput mode. When a batch fails, its messages are retried one at a
// time (each in its own transaction, with the full retry budget), so only
// the failing message is dead-lettered; a batch rolled back for a
// serialization failure or deadlock is first retried whole (see
// Config.MaxConflicts). cfg may be nil.
func NewBatch(db Beginner, name string, h BatchHandler, cfg *Config) (*Processor, error) {
	if h == nil {
		return nil, errors.New("consumer: handler is nil")
	}
	return newProcessor(db, name, nil, h, cfg)
}

func newProcessor(db Beginner, name string, h Handler, bh BatchHandler, cfg *Config) (*Processor, error) {
	if db == nil {
		return nil, errors.New("consumer: db is nil")
	}
	if name == "" {
		return nil, errors.New("consumer: name is empty; it scopes deduplication, so choose it once and keep it")
	}
	if _, err := checkID(name); err != nil {
		return nil, fmt.Errorf("consumer: name %.40q: must be valid UTF-8 without NUL bytes, at most %d bytes", name, maxMessageIDLen)
	}
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	table := pgx.Identifier{c.Schema, "processed_messages"}.Sanitize()
	// Every dedup insert also makes its transaction's COMMIT durable
	// (durableInsert): the one statement each transaction runs anyway.
	into := durableInsert + `INSERT INTO ` + table + ` (consumer, message_id) `
	strictOne := into + `SELECT $1, $2 FROM one`
	// One prepared statement per schema and connection; the name is an
	// identifier made of a hash of its text, so no user string reaches the
	// SQL and a changed text gets a name of its own.
	stmt := fmt.Sprintf("onceflow_dedup_%x", crc32.ChecksumIEEE([]byte(strictOne)))
	var oneSession chan struct{}
	switch db.(type) {
	case *pgx.Conn, *pgxpool.Conn:
		oneSession = make(chan struct{}, 1)
	}
	return &Processor{
		oneSession:  oneSession,
		db:          db,
		name:        name,
		handler:     h,
		batch:       bh,
		cfg:         c,
		hooks:       newHooks(c.Hooks),
		log:         c.Logger.With("consumer", name),
		insertOne:   strictOne + ` ON CONFLICT DO NOTHING`,
		insertAll:   into + `SELECT $1, unnest($2::text[]) FROM one ON CONFLICT DO NOTHING RETURNING message_id`,
		stmtName:    stmt,
		strictOne:   strictOne,
		beginInsert: `BEGIN; EXECUTE ` + stmt + `(` + literal(name) + `, `,
		running:     map[<-chan struct{}]map[*pgconn.PgConn]struct{}{},
	}, nil
}

// Name is the consumer name deduplication is scoped to.
func (p *Processor) Name() string { return p.name }

// Batch reports whether the Processor is in batch mode.
func (p *Processor) Batch() bool { return p.batch != nil }

// errAbandoned is returned when a message is left unfinished (shutdown,
// revocation): its offset must not be committed.
var errAbandoned = errors.New("consumer: message abandoned")

// runOne takes msg to a final state (committed, duplicate, dead-lettered)
// and returns nil, or returns an error when it abandons the message because
// ctx was canceled or stop closed.
//
// la is the worker's lookahead for pipelined commits, or nil.
func (p *Processor) runOne(ctx context.Context, stop <-chan struct{}, msg Message, t Transport, batchMode bool, la *lookahead) error {
	if msg.skip {
		return nil
	}
	if len(p.hooks.trace) > 0 {
		return p.traced(ctx, msg, func(ctx context.Context) error { return p.run(ctx, stop, msg, t, batchMode, la) })
	}
	return p.run(ctx, stop, msg, t, batchMode, la)
}

// run is runOne for a message that is not a skip.
func (p *Processor) run(ctx context.Context, stop <-chan struct{}, msg Message, t Transport, batchMode bool, la *lookahead) error {
	id, err := p.messageID(msg)
	if err != nil {
		return p.deadLetter(ctx, stop, msg, 0, 0, err, t)
	}
	msg.ID = id
	bo := p.newBackoff()
	// runs counts the handler's runs, failed the failures that spend
	// MaxAttempts, lost those that spend MaxLostConnections, retries the
	// failed attempts retried.
	var runs, failed, lost, retries int
	var lastErr error
	// commitUnknown is set while the last COMMIT's outcome is unknown (its
	// connection was lost) and no attempt since found the record missing.
	commitUnknown := false
	conflicts := 0 // serialization failures and deadlocks: they spend MaxConflicts
	for {
		// Once the lost-connection budget is spent, the next attempt only
		// learns whether the last lost COMMIT went through.
		resolve := lost >= p.cfg.MaxLostConnections
		outcome, dur, ran, err := p.attempt(ctx, stop, msg, batchMode, la, resolve)
		if ran {
			runs++
			commitUnknown = false // the record was not in: nothing had committed
		}
		var unavailable *unavailableError
		var lostConn *lostError
		switch {
		case err == nil:
			if outcome == Duplicate && commitUnknown {
				// The lost COMMIT went through (only its reply was
				// lost): the record is this delivery's, and so is the
				// effect.
				outcome = Processed
			}
			p.finished(ctx, msg, outcome, runs, retries, dur, 1, false)
			return nil
		case errors.Is(err, errNotCommitted):
			return p.deadLetter(ctx, stop, msg, runs, retries, lastErr, t)
		case ctx.Err() != nil:
			return errAbandoned
		case errors.As(err, &unavailable):
			// The database, not the message, failed: wait for it
			// without spending the message's budgets. A refused grant
			// is waited out too (README, "Roles and privileges"), but
			// said as what it is: no outage will end it.
			level, what := slog.LevelWarn, "consumer: database unavailable; retrying"
			switch {
			case isConflict(err):
				// At the dedup insert (BEGIN's statement): another
				// delivery of the message inserting it at once, say.
				what = "consumer: the dedup record's insert was rolled back for a serialization failure or deadlock; retrying"
			case isInsufficientPrivilege(err):
				level, what = slog.LevelError, `consumer: the database role lacks a privilege the consumer needs (README, "Roles and privileges"); retrying`
			}
			retries++
			if !p.retryAfterAt(ctx, level, stop, msg, bo, runs, err, what) {
				return errAbandoned
			}
		case errors.As(err, &lostConn):
			lost++
			lastErr = err
			commitUnknown = lostConn.atCommit
			retries++
			if !p.retryAfter(ctx, stop, msg, bo, runs, err, "consumer: connection lost while handling message; retrying",
				slog.Int("lost_connections", lost), slog.Int("max_lost_connections", p.cfg.MaxLostConnections)) {
				return errAbandoned
			}
		case p.retryConflict(err, &conflicts):
			lastErr = err
			retries++
			if !p.retryAfter(ctx, stop, msg, bo, runs, err, retryingConflicts,
				slog.Int("conflicts", conflicts), slog.Int("max_conflicts", p.cfg.MaxConflicts)) {
				return errAbandoned
			}
		default:
			failed++
			lastErr = err
			if IsPermanent(err) || failed >= p.cfg.MaxAttempts {
				return p.deadLetter(ctx, stop, msg, runs, retries, err, t)
			}
			retries++
			if !p.retryAfter(ctx, stop, msg, bo, runs, err, "consumer: handler failed; retrying", slog.Int("attempt", failed)) {
				return errAbandoned
			}
		}
	}
}

// retryAfter logs and reports a failed attempt of msg and waits its backoff;
// it reports false when ctx or stop ended the wait.
func (p *Processor) retryAfter(ctx context.Context, stop <-chan struct{}, msg Message, bo backoff.BackOff, runs int, err error, what string, attrs ...slog.Attr) bool {
	return p.retryAfterAt(ctx, slog.LevelWarn, stop, msg, bo, runs, err, what, attrs...)
}

// retryAfterAt is retryAfter logging at level.
func (p *Processor) retryAfterAt(ctx context.Context, level slog.Level, stop <-chan struct{}, msg Message, bo backoff.BackOff, runs int, err error, what string, attrs ...slog.Attr) bool {
	wait := bo.NextBackOff()
	p.log.LogAttrs(ctx, level, what, append([]slog.Attr{
		slog.String("topic", msg.Topic), slog.Int("partition", int(msg.Partition)), slog.Int64("offset", msg.Offset),
		slog.String("message_id", msg.ID), slog.Duration("backoff", wait), slog.Any("error", err)}, attrs...)...)
	ev := RetryEvent{Consumer: p.name, Message: msg, Attempt: runs, Err: err, Backoff: wait, Conflict: isConflict(err)}
	for _, h := range p.hooks.retry {
		h.OnRetry(ev)
	}
	if len(p.hooks.trace) > 0 {
		p.traceRetry(ctx, ev)
	}
	return sleep(ctx, stop, wait)
}

func (p *Processor) messageID(msg Message) (id string, err error) {
	// Config.MessageID may parse the payload: a poison message that makes
	// it panic would otherwise kill the process on every redelivery (G6).
	defer func() {
		if r := recover(); r != nil {
			id, err = "", fmt.Errorf("%w: Config.MessageID panicked: %v", ErrNoMessageID, r)
			p.log.Error("consumer: Config.MessageID panicked; the message is dead-lettered",
				"topic", msg.Topic, "partition", msg.Partition, "offset", msg.Offset, "panic", r, "stack", string(debug.Stack()))
		}
	}()
	id, err = p.cfg.MessageID(msg)
	if err != nil {
		if !errors.Is(err, ErrNoMessageID) {
			err = fmt.Errorf("%w: %w", ErrNoMessageID, err)
		}
		return "", err
	}
	return checkID(id)
}

// attempt runs one transaction for msg and reports whether the handler
// ran. la, when not nil, may hold msg's transaction already begun, and may
// be handed the next message's (see commit). With resolve, the handler does
// not run: attempt reports Duplicate if msg's dedup record is in, else
// errNotCommitted.
func (p *Processor) attempt(ctx context.Context, stop <-chan struct{}, msg Message, batchMode bool, la *lookahead, resolve bool) (Outcome, time.Duration, bool, error) {
	start := time.Now()
	var tx pgx.Tx
	var release func()
	if c := la.take(msg); c != nil {
		tx, release = c.tx, c.release
	} else {
		var dup bool
		var err error
		tx, release, dup, err = p.begin(ctx, stop, msg)
		if errors.Is(err, errAbandoned) {
			return 0, 0, false, err // stopped while waiting for the session
		}
		if err != nil {
			if refusedForMessage(err, msg.ID) {
				return 0, 0, false, Permanent(err)
			}
			return 0, 0, false, &unavailableError{err}
		}
		if dup {
			return Duplicate, time.Since(start), false, nil
		}
	}
	committed := false
	defer func() {
		if !committed {
			rollback(ctx, tx)
		}
		release()
	}()
	if resolve {
		return 0, 0, false, errNotCommitted
	}
	var err error
	pc := p.handlerStarts(stop, tx)
	htx := &handlerTx{Tx: tx}
	if batchMode {
		err = p.call(ctx, func() error { return p.batch(ctx, htx, []Message{msg}) })
	} else {
		err = p.call(ctx, func() error { return p.handler(ctx, htx, msg) })
	}
	p.handlerEnded(stop, pc)
	if err == nil && !htx.ended.Load() {
		err = p.rolledBackBySQL(ctx, tx, msg.ID)
	}
	if err != nil {
		if errors.Is(err, pgx.ErrTxClosed) {
			err = p.endedByHandler(ctx, msg.ID, fmt.Errorf("consumer %s: message %s: the handler used tx after it ended (ending tx is the Processor's): %w", p.name, msg.ID, err))
			if IsPermanent(err) {
				p.log.Error("consumer: the handler ended its transaction itself and wrote on; the message is dead-lettered",
					"topic", msg.Topic, "partition", msg.Partition, "offset", msg.Offset, "message_id", msg.ID, "error", err)
			}
		} else if tx.Conn().IsClosed() {
			err = &lostError{err: err}
		}
		return 0, 0, true, err
	}
	if err := p.commit(ctx, tx, msg, la, &release); err != nil {
		return 0, 0, true, err
	}
	committed = true
	return Processed, time.Since(start), true, nil
}

// endedByHandler returns err, from a handler that used tx after ending it
// itself, as Permanent when the handler had committed tx: the dedup record
// is in, so a retry would take the message for a duplicate while what the
// handler wrote after its COMMIT is lost, and no retry mends the handler.
// After a Rollback of its own nothing of the attempt committed, and a retry
// is clean: err is returned as it is. id is the message's id (a batch's
// first: the batch's records commit together). The check runs in a
// transaction of its own, never on tx's connection: a pool's transaction
// hands its connection back to the pool when the handler commits it. When
// the check fails, or gets no connection within a few seconds (a pool
// held by handlers), the commit is assumed.
func (p *Processor) endedByHandler(ctx context.Context, id string, err error) error {
	if in, cerr := p.recorded(ctx, id); cerr != nil || in {
		return Permanent(err)
	}
	return err
}

// recorded reports whether id's dedup record is in, asked in a transaction
// of its own that inserts it and rolls back (a duplicate inserts nothing).
func (p *Processor) recorded(ctx context.Context, id string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	check, err := p.db.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer rollback(ctx, check)
	tag, err := check.Exec(ctx, p.insertOne, p.name, id)
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() == 0, nil
}

// acquirer is *pgxpool.Pool: with a connection of its own, the Processor
// sends BEGIN and the dedup insert in one round trip.
type acquirer interface {
	Acquire(ctx context.Context) (*pgxpool.Conn, error)
}

// begin starts msg's transaction with its dedup record inserted. It reports
// dup when the record already exists (no transaction is left open then).
// release must be called after the transaction ended.
//
// With a pool, BEGIN and the insert go to the server as one simple-protocol
// query, saving a round trip per message (a quarter of the cost of a
// one-statement handler). A duplicate then shows as a unique violation,
// which PostgreSQL logs as an ERROR; the transaction is rolled back and the
// connection stays usable. Other Beginners, Config.PlainBegin, and a pool
// whose server sessions do not keep the statement (lostStatement) get
// BEGIN, then INSERT … ON CONFLICT DO NOTHING.
func (p *Processor) begin(ctx context.Context, stop <-chan struct{}, msg Message) (tx pgx.Tx, release func(), dup bool, err error) {
	pool, ok := p.db.(acquirer)
	if !ok || p.plainBegin() {
		return p.beginPlain(ctx, stop, msg)
	}
	c, err := pool.Acquire(ctx)
	if err != nil {
		return nil, nil, false, fmt.Errorf("consumer %s: acquire connection: %w", p.name, err)
	}
	// Prepare is a no-op (no round trip) once the connection has the
	// statement, so the insert is parsed and planned once per connection.
	if _, err := c.Conn().Prepare(ctx, p.stmtName, p.strictOne); err != nil {
		c.Release()
		if p.lostStatement(ctx, err) {
			return p.beginPlain(ctx, stop, msg)
		}
		return nil, nil, false, fmt.Errorf("consumer %s: prepare dedup insert: %w", p.name, err)
	}
	tx, err = c.Conn().BeginTx(ctx, pgx.TxOptions{BeginQuery: p.beginInsert + literal(msg.ID) + ")"})
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == uniqueViolation {
			// The pool discards the connection if this fails.
			_, _ = c.Conn().Exec(ctx, "ROLLBACK")
			c.Release()
			return nil, nil, true, nil
		}
		_, _ = c.Conn().Exec(ctx, "ROLLBACK")
		c.Release()
		if p.lostStatement(ctx, err) {
			return p.beginPlain(ctx, stop, msg)
		}
		return nil, nil, false, fmt.Errorf("consumer %s: begin and record message %s: %w", p.name, msg.ID, err)
	}
	return tx, c.Release, false, nil
}

// durableInsert begins every dedup insert. The offset is committed once
// COMMIT returns, so with synchronous_commit off (a common database or
// role default, or a session-level SET a handler or, behind a pooler in
// transaction mode, another client left behind) a server crash just after
// it would lose the effect and its dedup record while Kafka holds the
// offset, and the message would never come again. So the insert raises
// off to on (the default) for its transaction; local, remote_write and
// remote_apply stay. It is checked in each transaction, on the server
// session that runs it, inside the one statement every transaction runs
// anyway (prepared, where the pool allows): a setting read once per
// connection would miss the two cases in parentheses, and a statement of
// its own cost 10-20% of a one-message transaction. "one" is the single
// row the insert selects its values from.
const durableInsert = `WITH durable AS (
    SELECT set_config('synchronous_commit', 'on', true) WHERE current_setting('synchronous_commit') = 'off'),
one AS (SELECT count(*) FROM durable)
`

// beginPlain is begin in two round trips, BEGIN and then INSERT … ON
// CONFLICT DO NOTHING, with no statement of the Processor's own on the
// server.
func (p *Processor) beginPlain(ctx context.Context, stop <-chan struct{}, msg Message) (pgx.Tx, func(), bool, error) {
	release, err := p.holdSession(ctx, stop)
	if errors.Is(err, errAbandoned) {
		return nil, nil, false, err
	}
	if err != nil {
		return nil, nil, false, fmt.Errorf("consumer %s: begin: %w", p.name, err)
	}
	tx, err := p.db.Begin(ctx)
	if err != nil {
		release()
		return nil, nil, false, fmt.Errorf("consumer %s: begin: %w", p.name, err)
	}
	tag, err := tx.Exec(ctx, p.insertOne, p.name, msg.ID)
	if err != nil || tag.RowsAffected() == 0 {
		rollback(ctx, tx)
		release()
		if err != nil {
			return nil, nil, false, fmt.Errorf("consumer %s: record message %s: %w", p.name, msg.ID, err)
		}
		return nil, nil, true, nil
	}
	return tx, release, false, nil
}

// holdSession waits for the one session when db is a single connection
// (see oneSession); release must be called once the transaction ended. A
// stop while waiting returns errAbandoned: nothing of the message has
// started, so Stop drops it at once.
func (p *Processor) holdSession(ctx context.Context, stop <-chan struct{}) (release func(), err error) {
	if p.oneSession == nil {
		return func() {}, nil
	}
	select {
	case p.oneSession <- struct{}{}:
		return func() { <-p.oneSession }, nil
	case <-stop:
		return nil, errAbandoned
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// rollback ends tx, not under ctx: a rollback that a canceled context
// stops before it is sent leaves pgx no choice but to close the
// connection (a pool's loses one; a single connection given as the
// Beginner would be lost for good).
func rollback(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = tx.Rollback(ctx)
}

// plainBegin reports whether messages begin with beginPlain and commit
// alone: Config.PlainBegin, or the server sessions lost the statement.
func (p *Processor) plainBegin() bool {
	return p.cfg.PlainBegin || p.unprepared.Load()
}

// lostStatement reports whether err says that the dedup statement the
// connection prepared is not on the server session (SQLSTATE 26000), or
// that one the connection never prepared is (42P05). Either means that
// the connection's transactions go to server sessions other than its own:
// a pooler in transaction mode (PgBouncer before 1.21) lends each
// transaction whichever server connection is free. Retrying cannot help
// (the statement is on some server sessions and not others, and a server
// session that closes takes it along), so from then on every message of
// the Processor begins with beginPlain, as with Config.PlainBegin; a Warn
// says so, once.
func (p *Processor) lostStatement(ctx context.Context, err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || (pgErr.Code != undefinedStatement && pgErr.Code != duplicateStatement) {
		return false
	}
	if p.unprepared.CompareAndSwap(false, true) {
		p.log.LogAttrs(ctx, slog.LevelWarn, "consumer: beginning every message without its prepared statement from now on, as with Config.PlainBegin: "+
			"the server session had lost it or had it already, so transactions move between server connections (a pooler in transaction mode, such as PgBouncer); set Config.PlainBegin there",
			slog.Any("error", err))
	}
	return true
}

// literal quotes s (valid UTF-8, no NUL) as a dollar-quoted string, which
// has no escapes whatever the server's standard_conforming_strings.
func literal(s string) string {
	tag := "$of$"
	for i := 0; strings.Contains(s, tag) || strings.HasSuffix(s, tag[:len(tag)-1]); i++ {
		tag = "$of" + strconv.Itoa(i) + "$"
	}
	return tag + s + tag
}

// call runs a handler, turning a panic into a PanicError.
func (p *Processor) call(ctx context.Context, fn func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			pe := &PanicError{Value: r, Stack: debug.Stack()}
			p.log.LogAttrs(ctx, slog.LevelError, "consumer: handler panicked",
				slog.Any("panic", r), slog.String("stack", string(pe.Stack)))
			err = pe
		}
	}()
	return usableError(fn())
}

// usableError returns err, or, when its methods panic (a nil
// *ValidationError returned as error, whose Error reads its receiver; a
// nil *pgconn.PgError wrapped), an error standing in for it. The handler's
// error is read outside the handler's recover (its text for the dead
// letter, errors.Is and As to classify it): a panic there stopped the
// partition, on every redelivery.
func usableError(err error) (out error) {
	if err == nil {
		return nil
	}
	defer func() {
		if r := recover(); r != nil {
			out = fmt.Errorf("consumer: the handler returned a %T whose methods or wrapped errors panic (%v); a nil pointer returned as an error?", err, r)
		}
	}()
	_ = err.Error()
	_ = IsPermanent(err)
	_ = errors.Is(err, pgx.ErrTxClosed)
	_ = isConflict(err)
	var pe *PanicError
	_ = errors.As(err, &pe)
	return err
}

// handlerTx is the transaction a handler gets. It notes whether the
// handler ended it through Commit or Rollback (pgx catches their misuse
// itself, ErrTxClosed): a *pgxpool.Tx then hands its connection back to
// the pool, whose state is another's to read from then on.
type handlerTx struct {
	pgx.Tx
	ended atomic.Bool
}

func (t *handlerTx) Commit(ctx context.Context) error {
	t.ended.Store(true)
	return t.Tx.Commit(ctx)
}

func (t *handlerTx) Rollback(ctx context.Context) error {
	t.ended.Store(true)
	return t.Tx.Rollback(ctx)
}

// rolledBackBySQL refuses, for good, a transaction the handler rolled back
// with SQL of its own (tx.Exec("ROLLBACK")) though it returned nil: its
// dedup record went with it, and what it wrote after committed on its own,
// outside the transaction. COMMIT now would count the message processed,
// and a retry would write that again. (A transaction ended by COMMIT holds
// the record: it is processed, as before.) Called only while tx holds its
// connection: the handler did not call tx.Commit or tx.Rollback.
func (p *Processor) rolledBackBySQL(ctx context.Context, tx pgx.Tx, id string) error {
	if c := tx.Conn(); c == nil || c.PgConn().TxStatus() != 'I' {
		return nil
	}
	if in, err := p.recorded(ctx, id); err == nil && in {
		return nil // committed by the handler's own COMMIT
	}
	return Permanent(fmt.Errorf("the handler ended its transaction with SQL of its own (ROLLBACK): what it wrote after committed outside it: %w", pgx.ErrTxClosed))
}

// handlerStarts registers tx's connection as the one of a handler running
// in the partition of stop, and returns it (nil if tx has none).
func (p *Processor) handlerStarts(stop <-chan struct{}, tx pgx.Tx) *pgconn.PgConn {
	c := tx.Conn()
	if c == nil {
		return nil
	}
	pc := c.PgConn()
	p.runningMu.Lock()
	defer p.runningMu.Unlock()
	m := p.running[stop]
	if m == nil {
		return nil // not a partition's (nothing can abandon it)
	}
	m[pc] = struct{}{}
	return pc
}

// handlerEnded undoes handlerStarts once the handler returned.
func (p *Processor) handlerEnded(stop <-chan struct{}, pc *pgconn.PgConn) {
	if pc == nil {
		return
	}
	p.runningMu.Lock()
	defer p.runningMu.Unlock()
	delete(p.running[stop], pc)
}

// closeRunning ends the transactions of the handlers still running in the
// partition of stop, which Stop abandons, instead of leaving them open
// until the handlers return: it cancels the statement each may be running
// (a backend busy in a statement, such as a lock wait, notices a closed
// socket only once the statement ends; and behind PgBouncer the cancel
// pgx sends on its own, after the socket closed, no longer finds the
// client), then closes each connection, so the server rolls the
// transactions back with their dedup records. The lock is held
// throughout, so a connection is cancelled and closed only while its
// handler runs, never once back in the pool; the cancels go out together
// and take at most a second.
func (p *Processor) closeRunning(stop <-chan struct{}) {
	p.runningMu.Lock()
	defer p.runningMu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for pc := range p.running[stop] {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = pc.CancelRequest(ctx)
		}()
	}
	wg.Wait()
	for pc := range p.running[stop] {
		_ = pc.Conn().Close() // net.Conn: safe beside the handler's use
	}
}

func (p *Processor) finished(ctx context.Context, msg Message, o Outcome, attempts, retries int, dur time.Duration, batch int, batched bool) {
	if len(p.hooks.trace) > 0 {
		p.traceFinished(ctx, msg, o, attempts, retries, batch)
	}
	if len(p.hooks.done) == 0 {
		return
	}
	ev := DoneEvent{Consumer: p.name, Message: msg, Outcome: o, Attempts: attempts, Retries: retries, Duration: dur, BatchSize: batch, Batched: batched}
	for _, h := range p.hooks.done {
		h.OnDone(ev)
	}
}

func (p *Processor) newBackoff() backoff.BackOff {
	return backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(p.cfg.MinBackoff),
		backoff.WithMaxInterval(p.cfg.MaxBackoff),
		backoff.WithMaxElapsedTime(0),
	)
}

// stopped reports whether stop is closed.
func stopped(stop <-chan struct{}) bool {
	select {
	case <-stop:
		return true
	default:
		return false
	}
}

// sleep waits d and reports true, or reports false when ctx or stop ends
// first.
func sleep(ctx context.Context, stop <-chan struct{}, d time.Duration) bool {
	if d <= 0 {
		select {
		case <-ctx.Done():
			return false
		case <-stop:
			return false
		default:
			return true
		}
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	case <-stop:
		return false
	}
}

func itoa(n int64) []byte { return strconv.AppendInt(nil, n, 10) }

// SQLSTATEs: unique_violation, invalid_sql_statement_name (a prepared
// statement does not exist) and duplicate_prepared_statement.
const (
	uniqueViolation    = "23505"
	undefinedStatement = "26000"
	duplicateStatement = "42P05"
	// The database's encoding has no equivalent of a character sent.
	untranslatableCharacter = "22P05"
)

// refusedForMessage reports whether err, from beginning a message's
// transaction with its dedup record, is the database refusing that
// message's id: a character the database's encoding cannot hold
// (SQLSTATE 22P05, with client_encoding UTF8 on, say, a LATIN1 database),
// which only an id with a character outside ASCII can cause, since every
// server encoding holds ASCII. Retried as "database unavailable", such a
// message held its partition forever (G6); it goes to the dead-letter topic
// at once instead. Any other refusal (a consumer name the database cannot
// hold, a trigger on processed_messages) fails every message alike: it is
// waited out and logged, not a reason to dead-letter them all.
func refusedForMessage(err error, id string) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == untranslatableCharacter && !isASCII(id)
}

// isASCII reports whether s holds ASCII characters only.
func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return false
		}
	}
	return true
}

// unavailableError marks a failure to get a working connection: acquiring
// one, or beginning the transaction and recording the message, failed.
// That is the database failing, not the message: such failures are retried
// with backoff for as long as they last and never spend a budget, so a
// database outage does not dead-letter the messages that arrive during it.
type unavailableError struct{ err error }

func (e *unavailableError) Error() string { return e.err.Error() }

func (e *unavailableError) Unwrap() error { return e.err }

// lostError marks an attempt whose connection was lost after its
// transaction began: while the handler ran, or at COMMIT (atCommit; the
// outcome is then unknown until the next attempt's dedup insert tells). It
// spends Config.MaxLostConnections.
type lostError struct {
	err      error
	atCommit bool
}

func (e *lostError) Error() string { return e.err.Error() }

func (e *lostError) Unwrap() error { return e.err }

// errNotCommitted reports that a message whose lost-connection budget is
// spent has no dedup record: no attempt committed, and it is dead-lettered.
var errNotCommitted = errors.New("consumer: message not committed")
