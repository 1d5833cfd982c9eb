package idempotency

import (
	"context"
	"errors"
	"net/http"
)

// Errors the middleware answers with and Fence.Do returns. Match them with
// errors.Is; StatusCode maps each to its HTTP status.
var (
	// ErrKeyMissing: the route requires an Idempotency-Key and the request
	// has none (HTTP 400).
	ErrKeyMissing = errors.New("idempotency: Idempotency-Key header required")
	// ErrKeyInvalid: the key is too long, empty or holds characters other
	// than printable ASCII (HTTP 400). Returned wrapped with the reason.
	ErrKeyInvalid = errors.New("idempotency: invalid Idempotency-Key")
	// ErrRequestTooLarge: the request body exceeds Config.MaxRequestBytes, or
	// the limit of an http.MaxBytesReader around it, so it cannot be
	// fingerprinted (HTTP 413).
	ErrRequestTooLarge = errors.New("idempotency: request body too large")
	// ErrInProgress: another request or Do call holds the key and is still
	// running (HTTP 409, with Retry-After), whatever the fingerprints: they
	// are compared once it is done. Retry later.
	ErrInProgress = errors.New("idempotency: a request with this key is in progress")
	// ErrMismatch: the key was first used with a different request (another
	// fingerprint) (HTTP 422). Use a new key for a new request.
	ErrMismatch = errors.New("idempotency: key already used for a different request")
	// ErrNotStored: the first request with this key completed, but its
	// response was larger than the storage limit, so it can neither be
	// replayed nor safely run again (HTTP 422). Use a new key.
	ErrNotStored = errors.New("idempotency: the first response to this key was too large to store; use a new key")
	// ErrLeaseLost: a leased claim expired and was taken over (or deleted)
	// before its result could be stored: the work may run twice. It is
	// also the cause with which a lease's holder is told to stop when
	// renewals fail (HTTP 503 if a Leased handler then answers nothing).
	ErrLeaseLost = errors.New("idempotency: lease lost before the result was stored")
)

// errScopeText: Config.Scope returned a scope PostgreSQL text cannot hold
// (HTTP 400). It comes from the request (a header with obs-text, say), so it
// is the request's to fix, not a server fault.
var errScopeText = errors.New("idempotency: the request's scope cannot be stored")

// errRequestBody: the request body could not be read to its end (shorter
// than its Content-Length, a malformed chunk, the client gone or too slow):
// it cannot be fingerprinted (HTTP 400). The request's fault, not the
// server's.
var errRequestBody = errors.New("idempotency: the request body could not be read")

// ScopeError is returned when Config.Scope fails for a request, typically
// because the caller is not authenticated (HTTP 401).
type ScopeError struct {
	Err error
}

func (e *ScopeError) Error() string { return "idempotency: scope: " + e.Err.Error() }

// Unwrap returns the scope function's error.
func (e *ScopeError) Unwrap() error { return e.Err }

// StatusCode returns the HTTP status the middleware answers err with: 400,
// 401, 409, 413 or 422 for the package's errors (400 too for a request body
// that could not be read to its end); 503 for ErrLeaseLost and
// for an error wrapping a context's end (the client left, a timeout,
// including the database's connect timeout); 500 for anything else.
func StatusCode(err error) int {
	var scopeErr *ScopeError
	switch {
	case errors.Is(err, ErrKeyMissing), errors.Is(err, ErrKeyInvalid), errors.Is(err, errScopeText), errors.Is(err, errRequestBody):
		return http.StatusBadRequest
	case errors.As(err, &scopeErr):
		return http.StatusUnauthorized
	case errors.Is(err, ErrInProgress):
		return http.StatusConflict
	case errors.Is(err, ErrRequestTooLarge):
		return http.StatusRequestEntityTooLarge
	case errors.Is(err, ErrMismatch), errors.Is(err, ErrNotStored):
		return http.StatusUnprocessableEntity
	case errors.Is(err, ErrLeaseLost), errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}
