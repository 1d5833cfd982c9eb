package idempotency

import (
	"context"
	"errors"
	"strconv"
)

// Outcome is what the middleware did with a request whose key it looked up.
type Outcome int

const (
	// OutcomeClaimed: the request claimed its key and the handler runs.
	OutcomeClaimed Outcome = iota + 1
	// OutcomeReplayed: the stored response was replayed.
	OutcomeReplayed
	// OutcomeConflict: another request with the key is in progress (409).
	OutcomeConflict
	// OutcomeMismatch: the key was first used with another request (422).
	OutcomeMismatch
	// OutcomeNotStored: the key's first response was too large to store
	// (422, ErrNotStored).
	OutcomeNotStored
)

func (o Outcome) String() string {
	switch o {
	case OutcomeClaimed:
		return "claimed"
	case OutcomeReplayed:
		return "replayed"
	case OutcomeConflict:
		return "conflict"
	case OutcomeMismatch:
		return "mismatch"
	case OutcomeNotStored:
		return "not_stored"
	}
	return "Outcome(" + strconv.Itoa(int(o)) + ")"
}

// RequestEvent describes one request's Outcome.
type RequestEvent struct {
	Outcome Outcome
	Mode    Mode
	Key     string // the Idempotency-Key, unquoted
}

// Hook observes the middleware's decisions, for tracing or metrics: an
// adapter can record e.Outcome on the request's span, which it finds in ctx
// (the request's context), without this package importing a tracing
// library. Hooks must be cheap and safe for concurrent use.
type Hook interface {
	// OnRequest is called once per request that carried a valid key and
	// reached the key's record, before the handler runs (OutcomeClaimed)
	// or the answer is written (every other Outcome). It is not called for
	// requests refused earlier (400, 401, 413) or failed by the database.
	OnRequest(ctx context.Context, e RequestEvent)
}

func (m *Middleware) observe(ctx context.Context, o Outcome, key string) {
	if m.cfg.Hook != nil {
		m.cfg.Hook.OnRequest(ctx, RequestEvent{Outcome: o, Mode: m.cfg.Mode, Key: key})
	}
}

// outcomeOf maps a record's check to an Outcome.
func outcomeOf(err error) Outcome {
	switch {
	case err == nil:
		return OutcomeReplayed
	case errors.Is(err, ErrInProgress):
		return OutcomeConflict
	case errors.Is(err, ErrMismatch):
		return OutcomeMismatch
	case errors.Is(err, ErrNotStored):
		return OutcomeNotStored
	}
	return 0
}
