package idempotency

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"maps"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/net/http/httpguts"

	"github.com/onceflow/onceflow/migrations"
)

// DB is what the package needs from PostgreSQL: pass a *pgxpool.Pool.
// Any pgx QueryExecMode works, exec and simple_protocol included (PgBouncer
// in transaction mode).
//
// Unlike the outbox's writers, which take the caller's transaction, New,
// NewFence and Do refuse a pgx.Tx and a single connection (*pgx.Conn,
// *pgxpool.Conn). A claim and its stored result must commit on their own:
// in the caller's transaction they would vanish with its rollback, and a
// redelivered message would run the work again. And a lease is renewed
// from a goroutine of its own while the work runs and its result is
// stored, which one connection cannot serve. A DB of another type (a
// wrapper) must likewise run each statement in its own transaction and be
// safe for concurrent use.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// checkDB refuses what DB's doc says cannot work.
func checkDB(db DB) error {
	const pass = "pass the *pgxpool.Pool"
	switch db.(type) {
	case nil:
		return errors.New("idempotency: db is nil")
	case pgx.Tx:
		return errors.New("idempotency: db is a pgx.Tx: the claim and its stored result would commit or roll back " +
			"with that transaction, and after a rollback the work would run again; " + pass +
			" (in a consumer handler too: the fence must outlive the handler's transaction)")
	case *pgx.Conn, *pgxpool.Conn:
		return fmt.Errorf("idempotency: db is a single connection (%T): the lease is renewed from another goroutine "+
			"while the work runs, and a connection serves one goroutine at a time; %s", db, pass)
	}
	return nil
}

// querier is what one claim statement needs: DB, pgx.Tx and *pgx.Conn fit.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Record states, as stored in idempotency_keys.state.
const (
	stateRunning  = "running"
	stateDone     = "done"
	stateUnstored = "unstored"
)

// record is an idempotency_keys row as another caller sees it: live, or a
// dead holder's running claim (lapsed) refused to another request.
type record struct {
	state       string
	fingerprint []byte
	status      int
	headers     map[string][]string
	body        []byte
	lapsed      bool
}

// check decides what a caller with fingerprint fp gets from an existing
// record: nil means replay it. A nil fp skips the fingerprint comparison.
func (r *record) check(fp []byte) error {
	if r.state == stateRunning && !r.lapsed {
		// In progress, whatever the fingerprint: a Transactional claim
		// still running is not committed, so its fingerprint cannot be
		// compared, and both modes answer alike (409, the IETF draft's
		// answer for a request still being processed). Another request is
		// told 422 once the first is done, or once a dead holder's lease
		// has lapsed.
		return ErrInProgress
	}
	if fp != nil && !bytes.Equal(fp, r.fingerprint) {
		return ErrMismatch
	}
	switch r.state {
	case stateRunning:
		return ErrInProgress
	case stateUnstored:
		return ErrNotStored
	}
	return nil
}

// claim is one attempt to own a key.
type claim struct {
	scope, key, token string
	fingerprint       []byte
	// run is the claim's fencing token, set by tryClaim: its created_at in
	// microseconds (see FenceToken).
	run int64
	// heir is set by tryClaim when the claim took over a dead holder's
	// running claim within its window: that holder's effect may have
	// happened under the key, so releasing this claim must not forget it
	// (see release).
	heir bool
}

// store holds the SQL for one schema's idempotency_keys table.
type store struct {
	table                                              string
	lookupSQL, claimTxSQL, claimLeasedSQL, takeoverSQL string
	completeSQL, releaseSQL, lapseSQL, renewSQL        string
	purgeSQL                                           string
}

func newStore(schema string) (*store, error) {
	if schema == "" {
		schema = migrations.DefaultSchema
	}
	if err := migrations.ValidateSchema(schema); err != nil {
		return nil, err
	}
	t := pgx.Identifier{schema, "idempotency_keys"}.Sanitize()
	// A finished record is live until it expires; a running one while its
	// lease holds, whatever its window: a holder renewing its lease is still
	// at work, and taking its key over would run the work twice at once.
	// (Transactional claims have no lease and never commit running.)
	const live = `CASE WHEN k.state = 'running' THEN coalesce(k.lease_until > now(), false) ELSE k.expires_at > now() END`
	// A dead record may be taken over by the request with fingerprint $3
	// unless it is a running claim whose holder died (its lease lapsed), of
	// another request, that has not expired: the holder's side effect may
	// have happened under the key, and another request run under it would
	// be answered, downstream, with the first one's outcome.
	const takeable = `(k.state <> 'running' OR k.fingerprint = $3 OR k.expires_at <= now())`
	// A dead holder's running claim within its window: taking it over makes
	// the taker its heir (claim.heir).
	const deadHolder = `(k.state = 'running' AND k.expires_at > now())`
	claimSQL := func(lock string) string {
		// The INSERT takes a free key. Otherwise the outer SELECT reads the
		// record in the way, whether it is live, and whether this request
		// may take it over if dead; a dead one (expired, or running with a
		// lapsed lease) is taken over by takeoverSQL. A record
		// committed after this statement's snapshot is in the way but
		// invisible: the caller sees neither and runs the statement again.
		// DO NOTHING takes no row lock, so replays never write.
		return `WITH lock AS MATERIALIZED (SELECT ` + lock + ` AS got),
ins AS (
    INSERT INTO ` + t + ` (scope, key, fingerprint, state, token, lease_until, expires_at)
    SELECT $1::text, $2::text, $3::bytea, 'running', $4::uuid,
        now() + $5::float8 * interval '1 second', now() + $6::float8 * interval '1 second'
    FROM lock WHERE lock.got
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING created_at
)
SELECT (SELECT got FROM lock), (SELECT ` + micros("created_at") + ` FROM ins), coalesce(` + live + `, false), coalesce(` + takeable + `, false),
    coalesce(` + deadHolder + `, false), ` + recordColumns + `
FROM (SELECT) AS one
LEFT JOIN ` + t + ` AS k ON k.scope = $1 AND k.key = $2 AND NOT EXISTS (SELECT FROM ins)`
	}
	return &store{
		table: t,
		lookupSQL: `SELECT ` + recordColumns + ` FROM ` + t + ` AS k
WHERE k.scope = $1 AND k.key = $2 AND ` + live,
		// Transactional claims first take a transaction-scoped advisory lock on
		// the key: a concurrent claimer fails to get it and answers "in
		// progress" at once instead of blocking on the uncommitted row.
		claimTxSQL:     claimSQL(`pg_try_advisory_xact_lock($7::bigint)`),
		claimLeasedSQL: claimSQL(`true`),
		// UPDATE re-checks its WHERE on the newest row version, so of two
		// callers taking over one dead record, one wins; the loser changes
		// no row. A running record whose holder died (its lease lapsed) is
		// taken over only by the same request until it expires (takeable).
		// $7 is whether the record read was a dead holder's: a record
		// that became or ceased to be one since is not taken over, so the
		// claim knows whose heir it is. created_at, the fencing token, is
		// after the record's, whatever the clock says.
		takeoverSQL: `UPDATE ` + t + ` AS k SET fingerprint = $3, state = 'running', token = $4,
    lease_until = now() + $5::float8 * interval '1 second', status = NULL, headers = NULL, body = NULL,
    created_at = greatest(now(), k.created_at + interval '1 microsecond'), completed_at = NULL,
    expires_at = now() + $6::float8 * interval '1 second'
WHERE k.scope = $1 AND k.key = $2 AND NOT (` + live + `) AND ` + takeable + ` AND ` + deadHolder + ` = $7::boolean
RETURNING ` + micros("k.created_at"),
		// Every parameter is text, bytea, a number or cast, so the statements
		// need no server-described parameter types: they work in every pgx
		// QueryExecMode, exec and simple_protocol included (PgBouncer).
		// The window runs from the result, too: a result stored after its
		// claim's window (a renewed lease outlasts it) would be stored
		// expired, and the next call would run again. It runs from the
		// clock, not now(): in Transactional mode now() is the BEGIN before
		// the handler ran, and a handler slower than Window would commit a
		// record already expired.
		completeSQL: `UPDATE ` + t + ` SET state = $4, status = $5, headers = $6::jsonb, body = $7,
    completed_at = clock_timestamp(), lease_until = NULL,
    expires_at = greatest(expires_at, clock_timestamp() + $8::float8 * interval '1 second')
WHERE scope = $1 AND key = $2 AND token = $3`,
		releaseSQL: `DELETE FROM ` + t + ` WHERE scope = $1 AND key = $2 AND token = $3`,
		// A Leased request's or an heir's release keeps the record,
		// running with its lease lapsed: the same request may take it over
		// again at once, and another is refused until it expires
		// (takeable).
		lapseSQL: `UPDATE ` + t + ` SET lease_until = now() WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'running'`,
		// A renewal finds the claim while it carries its token: running,
		// or finished by this holder (renewals go on while the result is
		// stored, so the key is not taken over during a store's retries;
		// a finished record's lease is left alone).
		renewSQL: `UPDATE ` + t + ` SET lease_until = CASE WHEN state = 'running' THEN now() + $4::float8 * interval '1 second' ELSE lease_until END
WHERE scope = $1 AND key = $2 AND token = $3`,
		purgeSQL: `DELETE FROM ` + t + ` AS k USING (
    SELECT scope, key FROM ` + t + `
    WHERE expires_at <= now() AND (state <> 'running' OR lease_until IS NULL OR lease_until <= now())
    ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED
) AS d WHERE k.scope = d.scope AND k.key = d.key`,
	}, nil
}

// recordColumns are a record's columns as scanRecord reads them. The bytea
// columns are read as base64 text: in the exec and simple_protocol modes
// (PgBouncer in transaction mode) results come as text, and pgx reads
// bytea text only in the hex form, while a database or role may set
// bytea_output = 'escape' (a legacy application's setting); then every
// replay failed with "invalid hex format". base64 reads alike in every
// mode and under every setting, for a third more bytes than the binary
// form (half of hex's).
// micros is a timestamp column as microseconds since the epoch: an
// integer reads alike in every result format, where a timestamp's text
// follows DateStyle.
func micros(column string) string {
	return `(extract(epoch FROM ` + column + `) * 1000000)::int8`
}

const recordColumns = `k.state, encode(k.fingerprint, 'base64'), k.status, k.headers, encode(k.body, 'base64')`

func scanRecord(row pgx.Row, extra ...any) (*record, error) {
	var (
		state, fp, body *string
		rec             record
		status          *int32
	)
	dest := append(extra, &state, &fp, &status, &rec.headers, &body)
	if err := row.Scan(dest...); err != nil {
		return nil, err
	}
	if state == nil {
		return nil, nil
	}
	var err error
	if rec.fingerprint, err = decodeBytea(fp); err != nil {
		return nil, fmt.Errorf("read fingerprint: %w", err)
	}
	if rec.body, err = decodeBytea(body); err != nil {
		return nil, fmt.Errorf("read body: %w", err)
	}
	rec.state = *state
	if status != nil {
		rec.status = int(*status)
	}
	if err := decodeHeaders(rec.headers); err != nil {
		return nil, err
	}
	return &rec, nil
}

// decodeBytea decodes a bytea column read as encode(x, 'base64'), whose
// lines PostgreSQL breaks every 76 characters (the decoder skips newlines).
// NULL is nil.
func decodeBytea(b64 *string) ([]byte, error) {
	if b64 == nil {
		return nil, nil
	}
	out := make([]byte, base64.StdEncoding.DecodedLen(len(*b64)))
	n, err := base64.StdEncoding.Decode(out, []byte(*b64))
	return out[:n], err
}

// encodedHeaderPrefix marks, in the stored headers, a header whose values
// are base64: a value JSON text cannot carry as it is (not UTF-8: obs-text
// such as a Latin-1 file name; or holding NUL, which jsonb refuses). A
// space cannot begin a header name, so no header is mistaken for one.
const encodedHeaderPrefix = " base64 "

// encodeHeaders returns headers as stored: each header with a value JSON
// text would alter or refuse under encodedHeaderPrefix + its name, base64.
// A name that is not a valid header field name is left out: net/http does
// not send it either (so no stored name begins with the marker's space).
func encodeHeaders(headers map[string][]string) map[string][]string {
	out := make(map[string][]string, len(headers))
	for k, vs := range headers {
		if !httpguts.ValidHeaderFieldName(k) {
			continue
		}
		plain := true
		for _, v := range vs {
			plain = plain && utf8.ValidString(v) && !strings.ContainsRune(v, 0)
		}
		if plain {
			out[k] = vs
			continue
		}
		enc := make([]string, len(vs))
		for i, v := range vs {
			enc[i] = base64.StdEncoding.EncodeToString([]byte(v))
		}
		out[encodedHeaderPrefix+k] = enc
	}
	return out
}

// decodeHeaders undoes encodeHeaders in place.
func decodeHeaders(headers map[string][]string) error {
	for k, vs := range maps.Clone(headers) { // keys are added while it runs
		name, encoded := strings.CutPrefix(k, encodedHeaderPrefix)
		if !encoded {
			continue
		}
		dec := make([]string, len(vs))
		for i, v := range vs {
			b, err := base64.StdEncoding.DecodeString(v)
			if err != nil {
				return fmt.Errorf("stored header %s: %w", name, err)
			}
			dec[i] = string(b)
		}
		delete(headers, k)
		headers[name] = dec
	}
	return nil
}

// lookup returns the live record for a key, or nil. One round trip.
func (s *store) lookup(ctx context.Context, db querier, scope, key string) (*record, error) {
	rec, err := scanRecord(db.QueryRow(ctx, s.lookupSQL, scope, key))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	return rec, err
}

// errClaimSnapshot: a transactional claim raced another claim of its key
// and its transaction, REPEATABLE READ or SERIALIZABLE, cannot see the
// outcome (SQLSTATE 40001, the transaction aborted). The claim is run
// again in a new transaction: the handler has not run.
var errClaimSnapshot = errors.New("idempotency: the claim's snapshot missed a racing claim")

// isSerializationFailure reports SQLSTATE 40001. Under READ COMMITTED the
// claim statements never raise it; sessions defaulting to REPEATABLE READ
// or SERIALIZABLE do when a racing claim commits after their snapshot.
func isSerializationFailure(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "40001"
}

// tryClaim claims c.key for c.token, or returns the record in the way
// (claimed false). lease 0 means a transactional claim: run it in the
// transaction that will also store the response. Usually one round trip.
// It sets c.heir and c.run.
func (s *store) tryClaim(ctx context.Context, db querier, c *claim, lease, window time.Duration) (claimed bool, in *record, err error) {
	sql, args := s.claimLeasedSQL, []any{c.scope, c.key, c.fingerprint, c.token, nil, window.Seconds()}
	if lease > 0 {
		args[4] = lease.Seconds()
	} else {
		sql = s.claimTxSQL
		args = append(args, lockKey(s.table, c.scope, c.key))
	}
	for attempt := 0; ; attempt++ {
		var got, live, takeable, deadHolder bool
		var inserted *int64 // the new record's created_at, µs
		rec, err := scanRecord(db.QueryRow(ctx, sql, args...), &got, &inserted, &live, &takeable, &deadHolder)
		var pgErr *pgconn.PgError
		switch {
		case errors.As(err, &pgErr) && pgErr.Code == "54000": // program_limit_exceeded: the key does not fit the index
			return false, nil, fmt.Errorf("%w: %d bytes is too long (%s)", ErrKeyInvalid, len(c.key), pgErr.Message)
		case isSerializationFailure(err) && lease == 0:
			return false, nil, fmt.Errorf("%w: %w", errClaimSnapshot, err)
		case isSerializationFailure(err):
			// On its own, the statement reads a new snapshot next time.
		case err != nil:
			return false, nil, err
		case !got:
			return false, &record{state: stateRunning, fingerprint: c.fingerprint}, nil
		case inserted != nil:
			c.run = *inserted
			return true, nil, nil
		case rec != nil && live:
			return false, rec, nil
		case rec != nil && !takeable:
			// A dead holder's key, another request: refused, with no
			// takeover tried. The answer is the record as just read: this
			// request is answered as if before any retry of the holder's
			// that takes the key over after this read.
			rec.lapsed = true
			return false, rec, nil
		case rec != nil: // dead: take it over
			var created int64
			err := db.QueryRow(ctx, s.takeoverSQL, append(args[:6:6], deadHolder)...).Scan(&created)
			switch {
			case isSerializationFailure(err) && lease == 0:
				return false, nil, fmt.Errorf("%w: %w", errClaimSnapshot, err)
			case isSerializationFailure(err):
				// Another claimer changed the record: read it again.
			case err != nil && !errors.Is(err, pgx.ErrNoRows):
				return false, nil, err
			}
			if err == nil {
				c.heir, c.run = deadHolder, created
				return true, nil, nil
			}
			// Another claimer changed the record since it was read (took
			// it over, or finished or released it): the record read is
			// stale, so read the key again and answer from what won, not
			// from the dead record (whose fingerprint may differ from
			// that of a live claim of this very request).
		}
		if attempt == 10 {
			return false, nil, fmt.Errorf("claim of key %q kept racing with other claims", c.key)
		}
	}
}

// claimOwned claims c.key for a claim that commits on its own (a Leased
// request's, Do's), so that a claim which commits always has a holder to
// run it or give it up. pgx answers a cancelled context by breaking the
// connection: a claim that had committed by then held the key, renewed by
// nobody, and every retry got "in progress" until its lease lapsed. So the
// connection is taken under ctx (a caller gone while it waits for one sends
// nothing), and the statement, once it may be sent, runs detached from
// ctx: a caller gone leaves it at most a lease more (a claim it left
// behind would have lapsed by then anyway), and whatever it claimed after
// ctx ended is given up (abandon). The caller returns as soon as ctx ends.
func (s *store) claimOwned(ctx context.Context, db querier, c *claim, lease, window time.Duration, log func(string, ...any)) (claimed bool, in *record, err error) {
	if ctx.Err() != nil {
		return false, nil, ctxError(ctx)
	}
	conn, release := db, func() {}
	if p, ok := db.(interface {
		Acquire(context.Context) (*pgxpool.Conn, error)
	}); ok {
		pc, err := p.Acquire(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return false, nil, ctxError(ctx)
			}
			return false, nil, err
		}
		conn, release = pc, pc.Release
	}
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	// Once ctx ends, the statement has a lease more; the wait ends with
	// the statement (cancel).
	stopWatch := context.AfterFunc(ctx, func() {
		t := time.NewTimer(lease)
		defer t.Stop()
		select {
		case <-t.C:
			cancel()
		case <-sctx.Done():
		}
	})
	done := make(chan claimResult, 1)
	go func(r claimResult) {
		r.claimed, r.rec, r.err = s.tryClaim(sctx, conn, &r.c, lease, window)
		stopWatch()
		cancel()
		release()
		done <- r
	}(claimResult{c: *c})
	select {
	case r := <-done:
		gone := r.claimed && ctx.Err() != nil // ctx ended as the claim landed
		if gone || r.err != nil {
			go s.abandon(ctx, db, r, log)
		}
		if gone {
			return false, nil, ctxError(ctx)
		}
		*c = r.c
		return r.claimed, r.rec, r.err
	case <-ctx.Done():
		go func() { s.abandon(ctx, db, <-done, log) }()
		return false, nil, ctxError(ctx)
	}
}

// ctxError is ctx's end as its caller sees it: context.Canceled or
// DeadlineExceeded (StatusCode's 503), wrapped with its cause when it has
// one of its own (context.WithCancelCause).
func ctxError(ctx context.Context) error {
	if cause := context.Cause(ctx); cause != nil && cause != ctx.Err() {
		return fmt.Errorf("%w: %w", ctx.Err(), cause)
	}
	return ctx.Err()
}

type claimResult struct {
	c       claim
	claimed bool
	rec     *record
	err     error
}

// abandon gives up a claim its caller will not run: one that landed after
// the caller left is released (nothing ran under it; an heir's lapses), and
// one whose outcome is unknown (mayHaveCommitted) is lapsed by its token,
// as it may have committed as an insert or as a takeover of a dead
// holder's key: the same request may take the key at once, another body
// stays refused, as after a dead holder.
func (s *store) abandon(ctx context.Context, db querier, r claimResult, log func(string, ...any)) {
	bg, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	var err error
	switch {
	case r.claimed:
		err = s.release(bg, db, r.c)
	case r.err != nil && mayHaveCommitted(r.err):
		err = s.lapse(bg, db, r.c)
	default:
		return
	}
	if err != nil {
		log("idempotency: give up claim", "key", r.c.key, "error", err)
	}
}

// mayHaveCommitted reports whether an autocommit statement that failed with
// err may have committed all the same: its answer was lost (a broken
// connection, a context's end after it was sent), or the backend ended
// (FATAL, PANIC) after the commit, as one terminated while it waits for a
// synchronous standby does. An ERROR rolled the statement back, and an
// error before anything was sent (pgconn.SafeToRetry) ran nothing.
func mayHaveCommitted(err error) bool {
	if errors.Is(err, ErrKeyInvalid) || pgconn.SafeToRetry(err) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC"
	}
	return true
}

// complete stores the outcome of c. It fails with ErrLeaseLost when c no
// longer owns the record.
func (s *store) complete(ctx context.Context, db querier, c claim, window time.Duration, state string, status int, headers map[string][]string, body []byte) error {
	// The headers go as JSON text: a map has no encoding pgx can send
	// without the server describing the parameter first.
	var h any
	if headers != nil {
		j, err := json.Marshal(encodeHeaders(headers))
		if err != nil {
			return fmt.Errorf("encode headers: %w", err)
		}
		h = string(j)
	}
	tag, err := db.Exec(ctx, s.completeSQL, c.scope, c.key, c.token, state, status, h, body, window.Seconds())
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 0 {
		return ErrLeaseLost
	}
	return nil
}

// completeRetrying stores c's outcome like complete, after work whose
// effect has happened outside the claim's transaction (Leased mode and
// Fence.Do). A result left unstored would keep the key running until its
// lease lapses and then let a retry run the work again, so a failure (a
// database blip) is tried again, backing off, until budget has passed,
// the last attempt at its end; the caller waits meanwhile, and keeps
// renewing the lease, so no retry takes the key over. It stops at once on
// ErrLeaseLost: another caller took the key over (the lease lapsed in a
// longer outage), and storing can no longer help.
func (s *store) completeRetrying(db querier, c claim, budget, window time.Duration, state string, status int, headers map[string][]string, body []byte, log func(string, ...any)) error {
	deadline := time.Now().Add(budget)
	bo := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(50*time.Millisecond),
		backoff.WithMaxInterval(time.Second),
		backoff.WithMaxElapsedTime(0),
	)
	for attempts := 1; ; attempts++ {
		// Each attempt gets the 10 s a single attempt always had.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := s.complete(ctx, db, c, window, state, status, headers, body)
		cancel()
		if err == nil || errors.Is(err, ErrLeaseLost) {
			return err
		}
		if attempts == 1 {
			log("idempotency: store result failed; trying again", "scope", c.scope, "key", c.key, "error", err)
		}
		left := time.Until(deadline)
		if left <= 0 {
			return fmt.Errorf("%w (%d attempts over %s)", err, attempts, budget)
		}
		// The last wait ends at the deadline: a blip shorter than the
		// budget is outlasted.
		time.Sleep(min(bo.NextBackOff(), left))
	}
}

// release gives up c's claim so the key can run again: it deletes the
// record, or, for an heir (c.heir), lapses its lease, so that only the same
// request (fingerprint) may run under the key until the record expires, as
// before the heir took it over: the dead holder's effect may have happened.
func (s *store) release(ctx context.Context, db querier, c claim) error {
	if c.heir {
		return s.lapse(ctx, db, c)
	}
	_, err := db.Exec(ctx, s.releaseSQL, c.scope, c.key, c.token)
	return err
}

// lapse gives up c's claim and keeps its record, running with its lease
// lapsed: the same request may take the key over at once, another is
// refused until the record expires (takeable).
func (s *store) lapse(ctx context.Context, db querier, c claim) error {
	_, err := db.Exec(ctx, s.lapseSQL, c.scope, c.key, c.token)
	return err
}

// renew extends c's lease; false means c lost the claim.
func (s *store) renew(ctx context.Context, db querier, c claim, lease time.Duration) (bool, error) {
	tag, err := db.Exec(ctx, s.renewSQL, c.scope, c.key, c.token, lease.Seconds())
	return err == nil && tag.RowsAffected() == 1, err
}

// keepLease renews c's lease every lease/3 until the returned stop is
// called. held is when the claim was sent: the lease holds at least until
// held+lease, and after each successful renewal until its send time+lease.
// keepLease cancels onLost's context with ErrLeaseLost when the claim is
// lost, and also when renewals keep failing until only lease/6 of the lease
// is left, so the work is told to stop while the key is still its own and no
// other caller can have taken it over; it goes on renewing until stop.
func (s *store) keepLease(db querier, c claim, lease time.Duration, held time.Time, onLost context.CancelCauseFunc, log func(string, ...any)) (stop func()) {
	done := make(chan struct{})
	exited := make(chan struct{})
	every, margin := lease/3, lease/6
	go func() {
		defer close(exited)
		tick := time.NewTicker(every)
		defer tick.Stop()
		giveUpAt := held.Add(lease - margin)
		giveUp := time.NewTimer(time.Until(giveUpAt))
		defer giveUp.Stop()
		for {
			select {
			case <-done:
				return
			case <-giveUp.C:
				log("idempotency: lease not renewed in time; cancelling the work before it lapses",
					"scope", c.scope, "key", c.key, "lease", lease)
				onLost(fmt.Errorf("%w: renewals failed for %s, so the work was stopped before the lease lapsed",
					ErrLeaseLost, (lease - margin).Round(time.Millisecond)))
				// Go on renewing: work that ignores its context keeps its key
				// if the database comes back.
				giveUpAt = time.Time{}
				continue
			case <-tick.C:
			}
			sent := time.Now()
			deadline := sent.Add(every)
			if !giveUpAt.IsZero() && giveUpAt.Before(deadline) {
				deadline = giveUpAt
			}
			ctx, cancel := context.WithDeadline(context.Background(), deadline)
			ok, err := s.renew(ctx, db, c, lease)
			cancel()
			switch {
			case err != nil:
				log("idempotency: renew lease", "scope", c.scope, "key", c.key, "error", err)
			case !ok:
				log("idempotency: lease lost", "scope", c.scope, "key", c.key)
				onLost(ErrLeaseLost)
				return
			default:
				if !giveUpAt.IsZero() {
					giveUpAt = sent.Add(lease - margin)
					giveUp.Reset(time.Until(giveUpAt))
				}
			}
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(done); <-exited }) }
}

// lockKey is the advisory lock key of (table, scope, key): FNV-1a 64 over
// the length-prefixed parts. A collision only makes an unrelated concurrent
// request see "in progress" once.
func lockKey(table, scope, key string) int64 {
	h := fnv.New64a()
	for _, part := range []string{table, scope, key} {
		fmt.Fprintf(h, "%d:%s", len(part), part)
	}
	return int64(h.Sum64())
}

func newToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	var sb strings.Builder
	h := hex.EncodeToString(b[:])
	sb.WriteString(h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:])
	return sb.String()
}
