package otelonceflow

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/idempotency"
)

// Attributes HTTPHook sets on the request's span.
const (
	// AttrIdempotencyOutcome is what the middleware did with the request:
	// claimed, replayed, conflict (409), mismatch (422) or not_stored (422).
	AttrIdempotencyOutcome = attribute.Key("onceflow.idempotency.outcome")
	// AttrIdempotencyMode is the middleware's mode: transactional or leased.
	AttrIdempotencyMode = attribute.Key("onceflow.idempotency.mode")
)

// HTTPHook is an idempotency.Hook that records each keyed request's outcome
// on the span in the request's context, the server span an HTTP
// instrumentation such as otelhttp started. It starts no span of its own.
// Safe for concurrent use.
type HTTPHook struct{}

var _ idempotency.Hook = HTTPHook{}

// NewHTTPHook returns an HTTPHook; set it as idempotency.Config.Hook.
func NewHTTPHook() HTTPHook { return HTTPHook{} }

// OnRequest implements idempotency.Hook.
func (HTTPHook) OnRequest(ctx context.Context, e idempotency.RequestEvent) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	span.SetAttributes(AttrIdempotencyOutcome.String(e.Outcome.String()), AttrIdempotencyMode.String(e.Mode.String()))
}
