// Package otelonceflow carries an OpenTelemetry trace from an HTTP request
// through the outbox and Kafka to the consumer's commit, the way franz-go's
// kotel plugs into kgo: onceflow's core packages import no OpenTelemetry and
// call small hooks, which this package provides.
//
// Three lines get the trace:
//
//		mw, err := idempotency.New(pool, &idempotency.Config{Scope: user, Hook: otelonceflow.NewHTTPHook()})
//		events, err := outbox.NewWriter(&outbox.Config{Inject: otelonceflow.NewInjector()})
//		p, err := consumer.New(pool, "shipping", handle, &consumer.Config{Hooks: []consumer.Hook{otelonceflow.NewConsumer()}})
//
//	  - NewHTTPHook records on the request's span (started by an HTTP
//	    instrumentation such as otelhttp) whether the Idempotency-Key was
//	    claimed, replayed, conflicted (409) or mismatched (422).
//	  - NewInjector writes the W3C trace context of outbox.Write's ctx
//	    (traceparent, tracestate; baggage with WithPropagator) into the
//	    event's headers, which the relay publishes as record headers.
//	  - NewConsumer extracts it from the record and runs the handler's
//	    transaction inside a consumer span, a child of the producer's span,
//	    with OpenTelemetry's messaging attributes and whether the message was
//	    a duplicate, retried or dead-lettered. A dead-letter record keeps the
//	    trace headers.
//
// With no hook configured, onceflow does no tracing work and allocates
// nothing for it.
package otelonceflow
