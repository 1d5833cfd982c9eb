package idempotency

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"
	"unicode/utf8"
)

// FenceConfig configures a Fence. The zero value is usable.
type FenceConfig struct {
	// Schema holds onceflow's tables. Defaults to "onceflow".
	Schema string
	// Namespace separates this fence's keys from other fences' (and from
	// HTTP keys): the same key in two namespaces is two operations.
	// Defaults to "default".
	Namespace string
	// Lease is how long a claim holds the key without renewal; Do renews it
	// every Lease/3 while fn runs, and a claim whose lease holds is never
	// taken over, however long fn runs. If renewals fail until only Lease/6
	// is left, fn's context is cancelled (cause ErrLeaseLost) so fn can stop
	// before another caller may take the key. After a crash the key can be
	// taken over once the lease lapses. Defaults to 1 minute.
	Lease time.Duration
	// Window is how long a key's record, and so its stored result, lives
	// after the claim, and at least that long after the result is stored
	// (a claim still running lives as long as its lease).
	// Defaults to 24 hours.
	Window time.Duration
	// MaxResultBytes is the largest result stored. A larger result is
	// returned to the caller that ran fn, but later callers get
	// ErrNotStored. Defaults to 1 MiB.
	MaxResultBytes int
	// Logger receives warnings (failed lease renewals). Defaults to
	// slog.Default().
	Logger *slog.Logger
}

// Fence runs a function at most once per key while the key's record lives:
// the run-once fence for effects outside the database (calling a payment
// gateway from a Kafka consumer, sending an e-mail). It is safe for
// concurrent use.
type Fence struct {
	db    DB
	store *store
	scope string
	cfg   FenceConfig
}

// NewFence returns a Fence storing its records through db, a
// *pgxpool.Pool: a pgx.Tx or a single connection is refused (see DB), as
// the claim must commit on its own and its lease is renewed from another
// goroutine. cfg may be nil.
func NewFence(db DB, cfg *FenceConfig) (*Fence, error) {
	if err := checkDB(db); err != nil {
		return nil, err
	}
	c := FenceConfig{}
	if cfg != nil {
		c = *cfg
	}
	if c.Namespace == "" {
		c.Namespace = "default"
	}
	setDefault(&c.Lease, time.Minute)
	setDefault(&c.Window, 24*time.Hour)
	setDefault(&c.MaxResultBytes, 1<<20)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	switch {
	case c.Lease < 10*time.Millisecond:
		return nil, fmt.Errorf("idempotency: FenceConfig.Lease must be at least 10ms, got %s", c.Lease)
	case c.Window < time.Second:
		return nil, fmt.Errorf("idempotency: FenceConfig.Window must be at least 1s, got %s", c.Window)
	case c.Window < c.Lease:
		return nil, fmt.Errorf("idempotency: FenceConfig.Window (%s) must not be shorter than FenceConfig.Lease (%s)", c.Window, c.Lease)
	case c.MaxResultBytes < 0:
		return nil, fmt.Errorf("idempotency: FenceConfig.MaxResultBytes must be positive, got %d", c.MaxResultBytes)
	}
	s, err := newStore(c.Schema)
	if err != nil {
		return nil, fmt.Errorf("idempotency: FenceConfig.Schema: %w", err)
	}
	return &Fence{db: db, store: s, scope: "do:" + c.Namespace, cfg: c}, nil
}

// Do runs fn at most once per key while the key's record lives (Window) and
// returns its result; later calls with the key get the stored result without
// running fn. Concretely:
//
//   - The first caller claims the key (one committed row with a lease), runs
//     fn with a context carrying the key (ClientKey(ctx); Key(ctx) is the
//     key scoped by Namespace, to pass downstream) and stores the result.
//   - A caller while fn runs gets ErrInProgress at once; retry later.
//   - If fn returns an error, the claim is released and the error returned:
//     the next call runs fn again.
//   - If the process dies while fn runs, the key stays claimed until the
//     lease lapses (Lease; renewed while fn runs, for as long as fn runs),
//     then the next call runs fn again.
//   - If lease renewals fail until only Lease/6 of the lease is left, or the
//     claim is found lost, fn's context is cancelled with cause ErrLeaseLost
//     while no other caller can have taken the key: an fn that returns when
//     its context is done does not run concurrently with another run, as
//     long as its process runs. A process paused past its lease (stopped,
//     a frozen VM, a long stall) runs no timer, so nothing cancels fn, and
//     it resumes while another caller's run, which took the key over, is
//     under way. Where that must not reach the downstream, pass it
//     FenceToken(ctx): the later run's is greater, so a downstream that
//     refuses a token lower than the highest it has seen for the key
//     refuses the paused one.
//
// What it cannot promise: an effect outside the database and the stored
// result do not commit together. If the process dies after the gateway
// charged the card but before the result was stored, the next call after the
// lease runs fn again. Give the downstream Key(ctx) (most payment APIs take
// an idempotency key; Key(ctx) is key scoped by Namespace) so it deduplicates
// that re-run: the fence makes
// re-runs rare and serial, the downstream makes them harmless.
//
// The claim commits on its own, outside any transaction of the caller's:
// in a consumer handler, pass the pool, not the handler's pgx.Tx, so that a
// rollback of the handler's transaction and the redelivery it causes do not
// run fn again (NewFence refuses a pgx.Tx and a single connection; see DB).
//
// If storing the result fails after fn succeeded, Do tries again, backing
// off, for up to Lease (a database blip must not let a later call run fn
// again); if it still cannot, Do returns the result together with the error
// (ErrLeaseLost at once if another caller took the key over).
func (f *Fence) Do(ctx context.Context, key string, fn func(ctx context.Context) ([]byte, error)) ([]byte, error) {
	switch {
	case key == "":
		return nil, fmt.Errorf("%w: empty", ErrKeyInvalid)
	case !utf8.ValidString(key) || strings.ContainsRune(key, 0):
		// The key is PostgreSQL text: a message id of arbitrary bytes
		// would fail the same way on every try. Hex-encode such keys.
		return nil, fmt.Errorf("%w: %q is not valid UTF-8 without NUL (hex-encode a binary key)", ErrKeyInvalid, key)
	}
	c := claim{scope: f.scope, key: key, token: newToken(), fingerprint: []byte{}}
	held := time.Now()
	claimed, rec, err := f.store.claimOwned(ctx, f.db, &c, f.cfg.Lease, f.cfg.Window, f.cfg.Logger.Warn)
	if errors.Is(err, ErrKeyInvalid) {
		return nil, err
	}
	if err != nil {
		return nil, fmt.Errorf("idempotency: claim key %q: %w", key, err)
	}
	if !claimed {
		if err := rec.check(nil); err != nil {
			return nil, err
		}
		return rec.body, nil
	}
	bg := context.WithoutCancel(ctx)
	fctx, cancel := context.WithCancelCause(withRun(ctx, &c))
	defer cancel(nil)
	stop := f.store.keepLease(f.db, c, f.cfg.Lease, held, cancel, f.cfg.Logger.Warn)
	returned := false
	defer func() {
		if returned {
			return
		}
		// fn ended the goroutine (runtime.Goexit, as t.FailNow does): stop
		// renewing and release the key, as for a panic, or the lease
		// would be renewed for good.
		stop()
		sctx, scancel := context.WithTimeout(bg, 10*time.Second)
		defer scancel()
		if rerr := f.store.release(sctx, f.db, c); rerr != nil {
			f.cfg.Logger.Warn("idempotency: release claim", "key", key, "error", rerr)
		}
	}()
	result, err := runGuarded(fctx, fn)
	returned = true
	// The lease is renewed while the result is stored, through its
	// retries: another call must not take the key over meanwhile.
	defer stop()
	sctx, scancel := context.WithTimeout(bg, 10*time.Second)
	defer scancel()
	if err != nil {
		stop()
		if rerr := f.store.release(sctx, f.db, c); rerr != nil {
			f.cfg.Logger.Warn("idempotency: release claim", "key", key, "error", rerr)
		}
		var p *panicError
		if errors.As(err, &p) {
			panic(p.value)
		}
		return nil, err
	}
	state, stored := stateDone, result
	if len(result) > f.cfg.MaxResultBytes {
		state, stored = stateUnstored, nil
	}
	if err := f.store.completeRetrying(f.db, c, f.cfg.Lease, f.cfg.Window, state, 0, nil, stored, f.cfg.Logger.Warn); err != nil {
		return result, fmt.Errorf("idempotency: store result of key %q: %w", key, err)
	}
	return result, nil
}

type panicError struct{ value any }

func (p *panicError) Error() string { return fmt.Sprint("idempotency: panic: ", p.value) }

// runGuarded turns a panic in fn into an error, so the claim is released
// before the panic goes on.
func runGuarded(ctx context.Context, fn func(context.Context) ([]byte, error)) (result []byte, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &panicError{value: v}
		}
	}()
	return fn(ctx)
}

// Do runs fn at most once per key in the "onceflow" schema's default
// namespace, with the defaults of FenceConfig. db is a *pgxpool.Pool (a
// pgx.Tx or a single connection is refused: see DB). See Fence.Do.
func Do(ctx context.Context, db DB, key string, fn func(ctx context.Context) ([]byte, error)) ([]byte, error) {
	f, err := NewFence(db, nil)
	if err != nil {
		return nil, err
	}
	return f.Do(ctx, key, fn)
}
