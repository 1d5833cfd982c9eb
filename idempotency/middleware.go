package idempotency

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Header names.
const (
	// KeyHeader is the request header carrying the key (IETF
	// draft-ietf-httpapi-idempotency-key-header, Stripe).
	KeyHeader = "Idempotency-Key"
	// ReplayedHeader marks a response replayed from storage.
	ReplayedHeader = "Idempotent-Replayed"
)

// Mode says how a claim relates to the handler's own work.
type Mode int

const (
	// Transactional runs the claim, the handler's writes (through Tx) and the
	// stored response in one transaction: they commit together or not at
	// all, so a crash at any instant leaves no trace and a retry runs afresh.
	// Use it when the handler's effects are rows in the same database.
	Transactional Mode = iota
	// Leased commits the claim first, with a lease the middleware renews
	// while the handler runs, then stores the response. Use it when the
	// handler has effects outside the database (calls another service):
	// pass Key(ctx) (the key scoped by Config.Scope, not the client's bare
	// key) on so the downstream can deduplicate too. A request that
	// dies mid-way holds the key until its lease lapses; then a retry runs
	// the handler again (the same request only: another one under the key
	// gets 422 until its Window ends).
	Leased
)

func (m Mode) String() string {
	switch m {
	case Transactional:
		return "transactional"
	case Leased:
		return "leased"
	}
	return "Mode(" + strconv.Itoa(int(m)) + ")"
}

// Config configures a Middleware. Scope is required; every other field has
// a default.
type Config struct {
	// Schema holds onceflow's tables. Defaults to "onceflow".
	Schema string
	// Mode is Transactional or Leased. Defaults to Transactional.
	Mode Mode
	// Scope returns whose key a request carries, typically the
	// authenticated principal: the same key under two scopes is two
	// independent operations, and no scope can read another's responses. An
	// error answers 401 (see ScopeError); a scope that is not valid UTF-8,
	// or holds NUL, answers 400, as PostgreSQL text cannot hold it.
	// Required: New fails without it.
	// Only when every caller is one trusted party may it be SharedScope,
	// which lets any caller replay any other caller's stored responses.
	// There is no default.
	Scope func(r *http.Request) (string, error)
	// Fingerprint identifies the request a key was first used with; a retry
	// with a different fingerprint is refused with 422 (409 while the first
	// still runs, as any request under the key is then). body is the whole
	// request body. Defaults to SHA-256 over the method, the path with its
	// query, and the body. A nil fingerprint is an empty one: every request
	// under a key matches.
	Fingerprint func(r *http.Request, body []byte) []byte
	// KeyOptional lets requests without a key through, without any
	// idempotency (in Transactional mode the handler still gets a
	// transaction). Defaults to false: a missing key answers 400.
	KeyOptional bool
	// MaxKeyLength is the longest key accepted, in bytes; longer keys
	// answer 400. Defaults to 255.
	MaxKeyLength int
	// MaxRequestBytes is the largest request body read for the fingerprint;
	// larger requests answer 413. Defaults to 1 MiB.
	MaxRequestBytes int64
	// MaxResponseBytes is the largest response body stored, and the most
	// the middleware keeps in memory per response. A larger response still
	// reaches the client, but is not stored: the key is marked so a retry
	// answers 422 (ErrNotStored) instead of running again. In Transactional
	// mode, where nothing reaches the client before the commit, the part
	// beyond it waits in a temporary file (os.TempDir) until the commit.
	// Defaults to 1 MiB.
	MaxResponseBytes int
	// Lease is how long a Leased claim holds the key without renewal; the
	// middleware renews it every Lease/3 while the handler runs, and a claim
	// whose lease holds is never taken over, however long the handler runs.
	// If renewals fail until only Lease/6 is left, the request's context is
	// cancelled (cause ErrLeaseLost) so the handler can stop before a retry
	// may claim the key. A handler whose context ends (so, or because the
	// client left) and that returns without writing is answered 503; nothing
	// is stored and the claim is given up, so a retry runs it again (the
	// same request only, as after a 5xx: see StoreServerErrors). After a
	// crash the key is claimable again once the lease lapses. Defaults to 1
	// minute.
	Lease time.Duration
	// Window is how long a key's record, and so its replay, lives after the
	// claim, and at least that long after its response is stored (a Leased
	// claim still running lives as long as its lease); then the key may run
	// again and Purger deletes the record.
	// Defaults to 24 hours.
	Window time.Duration
	// StoreServerErrors stores 5xx responses like any other, so a retry
	// gets the 5xx instead of running the handler again. By default a 5xx
	// response (or a panic) releases the claim, so a retry runs the handler
	// again. In Leased mode only the same request may: the handler may have
	// called the downstream under Key(ctx) before it failed, so another
	// request under the key gets 422 until the Window ends, as after a
	// request that died. 4xx responses are always stored. In Transactional
	// mode a 5xx rolls the handler's writes back either way: a stored 5xx
	// is stored in a transaction of its own. Defaults to false.
	StoreServerErrors bool
	// ReplayHeaders lists the response headers stored and replayed. Defaults
	// to every header the handler set except Set-Cookie, Date,
	// Content-Length and hop-by-hop headers. The handler sees the headers
	// the middlewares around it set; only what it set, changed or deleted
	// is stored, and a replay applies that over what those middlewares set
	// for the retry (a header the handler set to the value it already had
	// is theirs to set again). A name net/http would not send is not
	// stored.
	ReplayHeaders []string
	// RetryAfter is the Retry-After hint sent with 409 answers. Defaults to
	// 1 second.
	RetryAfter time.Duration
	// ErrorHandler writes the middleware's own error answers (400, 401, 409,
	// 413, 422, 500, 503); StatusCode(err) gives the status. Defaults to a
	// text/plain answer with StatusCode(err) and err's message (5xx say
	// only their status: "internal server error", "service unavailable").
	ErrorHandler func(w http.ResponseWriter, r *http.Request, err error)
	// Hook is told each request's Outcome (claimed, replayed, 409, 422), for
	// example to record it on the request's trace span. Defaults to none.
	Hook Hook
	// Logger receives warnings (failed stores, lost leases). Defaults to
	// slog.Default().
	Logger *slog.Logger
}

// Middleware is net/http middleware for the Idempotency-Key header. It is
// safe for concurrent use; build one per set of routes sharing a Config.
type Middleware struct {
	db    DB
	store *store
	cfg   Config
}

// SharedScope is a Config.Scope that puts every request in one scope: any
// caller who sends a key another caller used gets that caller's stored
// response (status, headers, body). Use it only when every caller is one
// trusted party, such as a single internal service; anywhere else, scope
// keys by the authenticated principal.
func SharedScope(*http.Request) (string, error) { return "", nil }

// New returns a Middleware storing keys through db, a *pgxpool.Pool (a
// pgx.Tx or a single connection is refused: see DB). cfg must set Scope (the authenticated principal, or
// SharedScope explicitly); New fails without it.
func New(db DB, cfg *Config) (*Middleware, error) {
	if err := checkDB(db); err != nil {
		return nil, err
	}
	c := Config{}
	if cfg != nil {
		c = *cfg
	}
	if c.Scope == nil {
		return nil, errors.New("idempotency: Config.Scope is required: return the authenticated principal, " +
			"so no caller can replay another's responses (idempotency.SharedScope puts every caller in one scope)")
	}
	if c.Fingerprint == nil {
		c.Fingerprint = DefaultFingerprint
	}
	setDefault(&c.MaxKeyLength, 255)
	setDefault(&c.MaxRequestBytes, 1<<20)
	setDefault(&c.MaxResponseBytes, 1<<20)
	setDefault(&c.Lease, time.Minute)
	setDefault(&c.Window, 24*time.Hour)
	setDefault(&c.RetryAfter, time.Second)
	if c.ErrorHandler == nil {
		c.ErrorHandler = defaultErrorHandler
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	switch {
	case c.Mode != Transactional && c.Mode != Leased:
		return nil, fmt.Errorf("idempotency: Config.Mode: unknown mode %d", c.Mode)
	case c.MaxKeyLength < 0:
		return nil, fmt.Errorf("idempotency: Config.MaxKeyLength must be positive, got %d", c.MaxKeyLength)
	case c.MaxRequestBytes < 0:
		return nil, fmt.Errorf("idempotency: Config.MaxRequestBytes must be positive, got %d", c.MaxRequestBytes)
	case c.MaxResponseBytes < 0:
		return nil, fmt.Errorf("idempotency: Config.MaxResponseBytes must be positive, got %d", c.MaxResponseBytes)
	case c.Lease < 10*time.Millisecond:
		return nil, fmt.Errorf("idempotency: Config.Lease must be at least 10ms, got %s", c.Lease)
	case c.Window < time.Second:
		return nil, fmt.Errorf("idempotency: Config.Window must be at least 1s, got %s", c.Window)
	case c.Mode == Leased && c.Window < c.Lease:
		return nil, fmt.Errorf("idempotency: Config.Window (%s) must not be shorter than Config.Lease (%s) in Leased mode", c.Window, c.Lease)
	case c.RetryAfter < 0:
		return nil, fmt.Errorf("idempotency: Config.RetryAfter must not be negative, got %s", c.RetryAfter)
	}
	s, err := newStore(c.Schema)
	if err != nil {
		return nil, fmt.Errorf("idempotency: Config.Schema: %w", err)
	}
	return &Middleware{db: db, store: s, cfg: c}, nil
}

func setDefault[T int | int64 | time.Duration](v *T, d T) {
	if *v == 0 {
		*v = d
	}
}

// DefaultFingerprint is SHA-256 over the method, the path with its query and
// the body. The path is the one the client sent (r.RequestURI), not
// r.URL's, which http.StripPrefix shortens: one Middleware mounted under
// "/v1" and "/v2" would take /v2/orders for /v1/orders and replay the one
// under the other's key. Requests built by hand, without RequestURI, use
// r.URL's.
func DefaultFingerprint(r *http.Request, body []byte) []byte {
	uri := r.RequestURI
	if uri == "" {
		uri = r.URL.RequestURI()
	}
	h := sha256.New()
	io.WriteString(h, r.Method)
	h.Write([]byte{0})
	io.WriteString(h, uri)
	h.Write([]byte{0})
	h.Write(body)
	return h.Sum(nil)
}

func defaultErrorHandler(w http.ResponseWriter, r *http.Request, err error) {
	status := StatusCode(err)
	msg := err.Error()
	// A 5xx's error is the server's (a database error names its user,
	// database and address): the client gets the status's text only.
	if status >= 500 {
		msg = strings.ToLower(http.StatusText(status))
	}
	http.Error(w, msg, status)
}

type ctxKey int

const (
	txKey ctxKey = iota
	runKey
)

// run is what a keyed request or Do call's context carries.
type run struct {
	key, clientKey string
	token          int64
}

func withRun(ctx context.Context, c *claim) context.Context {
	return context.WithValue(ctx, runKey, &run{key: downstreamKey(c.scope, c.key), clientKey: c.key, token: c.run})
}

// downstreamKey is Key's value for a key in a scope: hex SHA-256 over both,
// length-prefixed, so two scopes' same key never meet downstream and the
// result fits any key limit (64 bytes of [0-9a-f]).
func downstreamKey(scope, key string) string {
	h := sha256.New()
	fmt.Fprintf(h, "onceflow idempotency key\x00%d:%s%d:%s", len(scope), scope, len(key), key)
	return hex.EncodeToString(h.Sum(nil))
}

// Tx returns the transaction a Transactional middleware gives the handler,
// or nil. Write the handler's rows
// through it: they commit with the stored response, or not at all. Its
// Commit and Rollback return ErrTxOwned and do nothing: answer 5xx to roll
// the handler's writes back, or use a savepoint (its Begin).
func Tx(ctx context.Context) pgx.Tx {
	tx, _ := ctx.Value(txKey).(pgx.Tx)
	return tx
}

// Key returns the key to pass to downstream services (as their own
// idempotency key) so they can deduplicate too, or "" outside a keyed
// request or Do call. It is derived from the scope and the key: the request's
// Config.Scope (the principal) and its Idempotency-Key, or the Fence's
// Namespace and Do's key. So it is the same on every retry, and two scopes
// that use the same key (two clients both sending "order-1") get different
// ones: a downstream deduplicating on the client's bare key would answer
// one principal with another's effect. It is 64 lowercase hex digits, within
// any key limit (Stripe's is 255). It depends on nothing else: two services
// calling one downstream account with the same scope and key (say, Fences
// in two databases both in namespace "default") get the same Key; give
// them different namespaces.
func Key(ctx context.Context) string {
	if r, _ := ctx.Value(runKey).(*run); r != nil {
		return r.key
	}
	return ""
}

// FenceToken returns the fencing token of a Leased request's or Do call's
// claim, or 0 (outside one, and in Transactional mode, whose claim cannot
// outlive its transaction). A claim that takes over a key whose lease
// lapsed gets a greater token than every earlier claim of the key (it is
// the claim's time on the database's clock, in microseconds since 1970,
// and a takeover's is forced past its predecessor's; only a claim made
// after the record expired and was purged, at least Window later, relies
// on the clock not stepping back). Pass it downstream with Key(ctx) when two
// runs must never overlap there: a holder that is paused past its lease (a
// stopped process, a frozen VM, a long stall) runs no timer, so nothing
// cancels it, and it resumes while a second run, which took the key over,
// is under way. A downstream that keeps the highest token seen per key
// and refuses a lower one refuses the stale holder.
func FenceToken(ctx context.Context) int64 {
	if r, _ := ctx.Value(runKey).(*run); r != nil {
		return r.token
	}
	return 0
}

// ClientKey returns the key as the client sent it (the Idempotency-Key
// header, unquoted) or as passed to Do, or "". It is unique only within its
// scope: pass Key, not ClientKey, to a downstream that deduplicates.
func ClientKey(ctx context.Context) string {
	if r, _ := ctx.Value(runKey).(*run); r != nil {
		return r.clientKey
	}
	return ""
}

// Handler wraps next. Per request: no key answers 400 (unless KeyOptional);
// a new key runs next once and stores its response; a retry gets the stored
// status, headers and body with "Idempotent-Replayed: true"; any request
// with the key while the first still runs gets 409 with Retry-After, whatever
// its fingerprint; once the first is done, the key with another request
// (fingerprint) gets 422.
//
// Responses are buffered and stored before they reach the client, so
// handlers cannot stream (Flush) or hijack the connection.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		m.serve(w, r, next)
	})
}

func (m *Middleware) fail(w http.ResponseWriter, r *http.Request, err error) {
	if errors.Is(err, ErrInProgress) {
		w.Header().Set("Retry-After", strconv.Itoa(int((m.cfg.RetryAfter+time.Second-1)/time.Second)))
	}
	// A 503 is a lost lease or the database out of reach, and worth a line
	// unless the client left: then it is nobody's fault.
	if code := StatusCode(err); code == http.StatusInternalServerError || code == http.StatusServiceUnavailable && r.Context().Err() == nil {
		m.cfg.Logger.WarnContext(r.Context(), "idempotency: request failed", "path", r.URL.Path, "error", err)
	}
	m.cfg.ErrorHandler(w, r, err)
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	key, err := parseKey(r.Header.Values(KeyHeader), m.cfg.MaxKeyLength)
	if err != nil {
		m.fail(w, r, err)
		return
	}
	if key == "" {
		if !m.cfg.KeyOptional {
			m.fail(w, r, ErrKeyMissing)
			return
		}
		m.serveWithoutKey(w, r, next)
		return
	}
	scope, err := m.cfg.Scope(r)
	if err != nil {
		m.fail(w, r, &ScopeError{Err: err})
		return
	}
	if !utf8.ValidString(scope) || strings.ContainsRune(scope, 0) {
		// The scope is stored as PostgreSQL text: such a scope, taken from
		// the request (a header with obs-text), would fail every request
		// with a database error. It is the request's to fix.
		// The scope itself is not echoed: it may be the principal.
		m.fail(w, r, fmt.Errorf("%w: it is not valid UTF-8 without NUL", errScopeText))
		return
	}
	body, err := readBody(r, m.cfg.MaxRequestBytes)
	if err != nil {
		m.fail(w, r, err)
		return
	}
	fp := m.cfg.Fingerprint(r, body)
	if fp == nil {
		fp = []byte{} // a Fingerprint that returns nil compares every request equal
	}
	c := claim{scope: "http:" + scope, key: key, token: newToken(), fingerprint: fp}
	r = r.WithContext(withRun(r.Context(), &c))
	if m.cfg.Mode == Leased {
		m.serveLeased(w, r, next, c)
	} else {
		m.serveTx(w, r, next, c)
	}
}

// replay answers from an existing record.
func (m *Middleware) replay(w http.ResponseWriter, r *http.Request, rec *record, fp []byte) {
	err := rec.check(fp)
	m.observe(r.Context(), outcomeOf(err), ClientKey(r.Context()))
	if err != nil {
		m.fail(w, r, err)
		return
	}
	writeResponse(w, rec.status, rec.headers, rec.body, true)
}

// rollbackTimeout bounds a rollback. It runs whether or not the client is
// still there (not under the request's context), but not for good: on a
// connection gone silent (the server alive, so TCP keepalive sees nothing
// wrong) it waited forever, and the client's 5xx with it. On timeout pgx
// closes the connection, and the server rolls back when it notices.
const rollbackTimeout = 5 * time.Second

func rollback(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	_ = tx.Rollback(ctx)
}

func (m *Middleware) serveTx(w http.ResponseWriter, r *http.Request, next http.Handler, c claim) {
	ctx := r.Context()
	// The replay path: one round trip, no transaction.
	rec, err := m.store.lookup(ctx, m.db, c.scope, c.key)
	if err != nil {
		m.fail(w, r, fmt.Errorf("idempotency: look up key: %w", err))
		return
	}
	if rec != nil {
		m.replay(w, r, rec, c.fingerprint)
		return
	}
	tx, rec, err := m.beginClaim(ctx, &c)
	if err != nil {
		m.fail(w, r, err)
		return
	}
	if tx == nil {
		m.replay(w, r, rec, c.fingerprint)
		return
	}
	committed := false
	defer func() {
		if !committed {
			rollback(ctx, tx)
		}
	}()
	m.observe(ctx, OutcomeClaimed, c.key)
	rw := newRecorder(w, m.cfg.MaxResponseBytes, false)
	defer rw.close()
	next.ServeHTTP(rw, r.WithContext(context.WithValue(ctx, txKey, handlerTx{tx}))) // a panic rolls back in the deferred func
	if rw.err != nil {
		m.fail(w, r, rw.err)
		return
	}
	status := rw.statusCode()
	if status >= 500 {
		// A 5xx says the request failed: its writes roll back, so no
		// business row outlives it. With StoreServerErrors the answer is
		// then stored under a claim of its own, and replayed.
		rollback(ctx, tx)
		if m.cfg.StoreServerErrors {
			m.storeErrorAlone(w, r, c, rw)
			return
		}
		rw.flush(false)
		return
	}
	if err := m.storeResponse(ctx, tx, c, rw); err != nil {
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "25P02" { // in_failed_sql_transaction
			m.fail(w, r, fmt.Errorf("idempotency: store response: %w", err))
			return
		}
		// A statement of the handler's failed and left the transaction
		// aborted: its writes and the claim are lost, and no response can be
		// stored in it.
		rollback(ctx, tx)
		if status < 400 {
			m.fail(w, r, fmt.Errorf("idempotency: the handler answered %d after a statement in its transaction failed; nothing was committed", status))
			return
		}
		m.storeErrorAlone(w, r, c, rw)
		return
	}
	if err := tx.Commit(ctx); err != nil {
		m.fail(w, r, fmt.Errorf("idempotency: commit: %w", err))
		return
	}
	committed = true
	rw.flush(false)
}

// beginClaim begins the transaction of a Transactional request and claims
// c's key in it. It returns the transaction, open, if the key was claimed;
// otherwise none (rolled back) and the record in the way. A claim whose
// snapshot missed a racing claim (sessions defaulting to REPEATABLE READ
// or SERIALIZABLE) is run again in a new transaction.
func (m *Middleware) beginClaim(ctx context.Context, c *claim) (pgx.Tx, *record, error) {
	for attempt := 1; ; attempt++ {
		tx, err := m.db.Begin(ctx)
		if err != nil {
			return nil, nil, fmt.Errorf("idempotency: begin: %w", err)
		}
		claimed, rec, err := m.store.tryClaim(ctx, tx, c, 0, m.cfg.Window)
		if claimed {
			return tx, nil, nil
		}
		rollback(ctx, tx)
		switch {
		case errors.Is(err, errClaimSnapshot) && attempt < 10:
		case err != nil:
			return nil, nil, fmt.Errorf("idempotency: claim key: %w", err)
		default:
			return nil, rec, nil
		}
	}
}

// storeErrorAlone stores and sends an error answer whose handler's
// transaction was rolled back (aborted by a unique violation answered as
// 409, say, or a 5xx under StoreServerErrors): the answer is stored like
// any other, with a claim of its own since the first one was rolled back. Should another request have claimed the key in
// between, this answer goes out unstored and that request answers for the
// key.
func (m *Middleware) storeErrorAlone(w http.ResponseWriter, r *http.Request, c claim, rw *recorder) {
	ctx := r.Context()
	err := pgx.BeginFunc(ctx, m.db, func(tx pgx.Tx) error {
		claimed, _, err := m.store.tryClaim(ctx, tx, &c, 0, m.cfg.Window)
		if err != nil || !claimed {
			return err
		}
		return m.storeResponse(ctx, tx, c, rw)
	})
	if err != nil {
		m.fail(w, r, fmt.Errorf("idempotency: store response: %w", err))
		return
	}
	rw.flush(false)
}

func (m *Middleware) storeResponse(ctx context.Context, db querier, c claim, rw *recorder) error {
	state, headers, body := m.outcome(rw)
	return m.store.complete(ctx, db, c, m.cfg.Window, state, rw.statusCode(), headers, body)
}

// outcome is what is stored of rw's response: a response too big to keep
// is marked unstored, so a retry answers 422 instead of running again.
func (m *Middleware) outcome(rw *recorder) (state string, headers map[string][]string, body []byte) {
	if rw.tooBig {
		return stateUnstored, nil, nil
	}
	return stateDone, m.replayHeaders(rw.changedHeader()), rw.body.Bytes()
}

func (m *Middleware) serveLeased(w http.ResponseWriter, r *http.Request, next http.Handler, c claim) {
	ctx := r.Context()
	held := time.Now()
	claimed, rec, err := m.store.claimOwned(ctx, m.db, &c, m.cfg.Lease, m.cfg.Window, m.cfg.Logger.Warn)
	if err != nil {
		m.fail(w, r, fmt.Errorf("idempotency: claim key: %w", err))
		return
	}
	if !claimed {
		m.replay(w, r, rec, c.fingerprint)
		return
	}
	m.observe(ctx, OutcomeClaimed, c.key)
	ctx = withRun(ctx, &c) // with its fencing token
	// From here the claim is committed: finish it (store or release) even if
	// the client goes away.
	bg := context.WithoutCancel(ctx)
	hctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := m.store.keepLease(m.db, c, m.cfg.Lease, held, cancel, m.cfg.Logger.Warn)
	rw := newRecorder(w, m.cfg.MaxResponseBytes, true)
	finished := false
	defer func() {
		if !finished { // the handler panicked
			stop()
			m.giveUp(bg, c)
		}
	}()
	next.ServeHTTP(rw, r.WithContext(hctx))
	finished = true
	if rw.status == 0 && hctx.Err() != nil {
		// The handler returned without answering after its context ended:
		// the client left, an outer timeout fired, or the lease was lost
		// (cause ErrLeaseLost). The recorder's default 200 would be stored
		// and replayed as a success for work that never happened, so
		// nothing is stored and the claim is given up, as for a 5xx: the
		// retry runs the handler. giveUp lapses only this claim's row (its
		// token), so it is harmless if another holder has taken the key
		// over.
		stop()
		m.giveUp(bg, c)
		m.fail(w, r, fmt.Errorf("idempotency: the handler returned without answering after its context ended: %w", context.Cause(hctx)))
		return
	}
	if rw.statusCode() >= 500 && !m.cfg.StoreServerErrors {
		stop()
		m.giveUp(bg, c)
		rw.flush(false)
		return
	}
	// The lease is renewed while the response is stored, through its
	// retries: a retry must not take the key over meanwhile.
	err = m.storeLeasedResponse(c, rw)
	stop()
	if err != nil {
		// The handler's effects happened: answer with them. A retry will see
		// the key in progress until the lease lapses, then run again.
		m.cfg.Logger.Warn("idempotency: store response", "key", c.key, "error", err)
	}
	rw.flush(false)
}

// storeLeasedResponse stores a Leased claim's response, trying again
// through a database blip for up to a lease before the client is answered:
// the handler's effect has happened, and a response left unstored would
// let the client's retry run it again.
func (m *Middleware) storeLeasedResponse(c claim, rw *recorder) error {
	state, headers, body := m.outcome(rw)
	return m.store.completeRetrying(m.db, c, m.cfg.Lease, m.cfg.Window, state, rw.statusCode(), headers, body, m.cfg.Logger.Warn)
}

// giveUp ends a Leased claim whose handler failed (5xx, panic, no answer)
// so the request may run again at once. The record stays, its lease
// lapsed, until the key's Window ends: the handler may have called the
// downstream under Key(ctx) before it failed, and another request run
// under the key would be answered, downstream, with the first one's
// outcome. Another body gets 422, as after a dead holder (store.release).
func (m *Middleware) giveUp(ctx context.Context, c claim) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := m.store.lapse(ctx, m.db, c); err != nil {
		m.cfg.Logger.Warn("idempotency: release claim", "key", c.key, "error", err)
	}
}

func (m *Middleware) serveWithoutKey(w http.ResponseWriter, r *http.Request, next http.Handler) {
	if m.cfg.Mode != Transactional {
		next.ServeHTTP(w, r)
		return
	}
	ctx := r.Context()
	tx, err := m.db.Begin(ctx)
	if err != nil {
		m.fail(w, r, fmt.Errorf("idempotency: begin: %w", err))
		return
	}
	committed := false
	defer func() {
		if !committed {
			rollback(ctx, tx)
		}
	}()
	rw := newRecorder(w, m.cfg.MaxResponseBytes, false)
	defer rw.close()
	next.ServeHTTP(rw, r.WithContext(context.WithValue(ctx, txKey, handlerTx{tx})))
	if rw.err != nil {
		m.fail(w, r, rw.err)
		return
	}
	if status := rw.statusCode(); status < 500 {
		err := tx.Commit(ctx)
		committed = true
		if errors.Is(err, pgx.ErrTxCommitRollback) {
			// A statement of the handler's failed (a unique violation it
			// answered 409, say) and the COMMIT rolled back. A client error
			// says nothing was written: answer it, as the keyed path does.
			// A success would describe writes never made.
			if status >= 400 {
				err = nil
			} else {
				err = fmt.Errorf("the handler answered %d after a statement in its transaction failed; nothing was committed: %w", status, err)
			}
		}
		if err != nil {
			m.fail(w, r, fmt.Errorf("idempotency: commit: %w", err))
			return
		}
	}
	rw.flush(false)
}

var unstoredHeaders = map[string]bool{
	"Set-Cookie": true, "Date": true, "Content-Length": true, "Connection": true,
	"Keep-Alive": true, "Transfer-Encoding": true, "Upgrade": true, "Trailer": true,
	"Proxy-Connection": true, ReplayedHeader: true,
}

func (m *Middleware) replayHeaders(h http.Header) map[string][]string {
	out := map[string][]string{}
	if m.cfg.ReplayHeaders != nil {
		for _, name := range m.cfg.ReplayHeaders {
			if v, ok := h[http.CanonicalHeaderKey(name)]; ok {
				out[http.CanonicalHeaderKey(name)] = v // empty: deleted
			}
		}
		return out
	}
	for k, v := range h {
		if !unstoredHeaders[k] {
			out[k] = v
		}
	}
	return out
}

// parseKey accepts a bare token (Stripe) or a structured-field string (the
// IETF draft: Idempotency-Key: "8e03978e-…"). "" means no key.
func parseKey(values []string, max int) (string, error) {
	switch len(values) {
	case 0:
		return "", nil
	case 1:
	default:
		return "", fmt.Errorf("%w: the header appears %d times", ErrKeyInvalid, len(values))
	}
	key := strings.TrimSpace(values[0])
	if len(key) >= 2 && key[0] == '"' && key[len(key)-1] == '"' {
		var sb strings.Builder
		inner := key[1 : len(key)-1]
		for i := 0; i < len(inner); i++ {
			ch := inner[i]
			if ch == '\\' && i+1 < len(inner) && (inner[i+1] == '"' || inner[i+1] == '\\') {
				i++
				ch = inner[i]
			} else if ch == '"' || ch == '\\' {
				return "", fmt.Errorf("%w: malformed quoted string", ErrKeyInvalid)
			}
			sb.WriteByte(ch)
		}
		key = sb.String()
	}
	switch {
	case key == "":
		return "", fmt.Errorf("%w: empty", ErrKeyInvalid)
	case len(key) > max:
		return "", fmt.Errorf("%w: %d bytes, longer than %d", ErrKeyInvalid, len(key), max)
	}
	for i := 0; i < len(key); i++ {
		if key[i] < 0x20 || key[i] > 0x7e {
			return "", fmt.Errorf("%w: byte %#x at %d is not printable ASCII", ErrKeyInvalid, key[i], i)
		}
	}
	return key, nil
}

// readBody reads the whole request body (at most max bytes) and puts it back
// for the handler.
func readBody(r *http.Request, max int64) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, max+1))
	_ = r.Body.Close()
	var tooBig *http.MaxBytesError
	if errors.As(err, &tooBig) {
		// An outer body limit (http.MaxBytesReader) smaller than ours.
		return nil, fmt.Errorf("%w: more than %d bytes", ErrRequestTooLarge, tooBig.Limit)
	}
	if err != nil {
		// The client's doing (a truncated body, a bad chunk, a connection
		// gone): 400, not a server failure.
		return nil, fmt.Errorf("%w: %w", errRequestBody, err)
	}
	if int64(len(body)) > max {
		return nil, fmt.Errorf("%w: more than %d bytes", ErrRequestTooLarge, max)
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	return body, nil
}

// ErrTxOwned is returned by Commit and Rollback of the transaction Tx gives
// a handler: the middleware commits it with the stored response, or rolls
// it back (a 5xx, a panic), and a handler that ended it would leave its
// rows without the record that stops a retry from writing them again.
var ErrTxOwned = errors.New("idempotency: the request's transaction is the middleware's to commit or roll back")

// handlerTx is the request's transaction as the handler sees it: all of it
// but its end. (A savepoint, tx.Begin, may still be committed or rolled
// back.)
type handlerTx struct{ pgx.Tx }

func (handlerTx) Commit(context.Context) error   { return ErrTxOwned }
func (handlerTx) Rollback(context.Context) error { return ErrTxOwned }
