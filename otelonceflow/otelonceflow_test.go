package otelonceflow_test

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/otelonceflow"
)

func TestInjectorAndExtractRoundTripTraceContextAndBaggage(t *testing.T) {
	t.Parallel()
	tp := sdktrace.NewTracerProvider()
	ctx, span := tp.Tracer("t").Start(context.Background(), "request")
	defer span.End()
	m, _ := baggage.NewMember("tenant", "acme")
	b, _ := baggage.New(m)
	ctx = baggage.ContextWithBaggage(ctx, b)

	// The default injector writes the trace context only.
	h := map[string]string{}
	otelonceflow.NewInjector().InjectHeaders(ctx, h)
	if h["traceparent"] == "" || h["baggage"] != "" {
		t.Errorf("default injector headers = %v, want traceparent without baggage", h)
	}
	// With baggage configured, both travel.
	both := otelonceflow.WithPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	h = map[string]string{}
	otelonceflow.NewInjector(both).InjectHeaders(ctx, h)
	if h["traceparent"] == "" || h["baggage"] != "tenant=acme" {
		t.Fatalf("injector headers = %v, want traceparent and baggage", h)
	}
	var hs []consumer.Header
	for k, v := range h {
		hs = append(hs, consumer.Header{Key: k, Value: []byte(v)})
	}
	got := otelonceflow.Extract(context.Background(), consumer.Message{Headers: hs}, both)
	if sc := trace.SpanContextFromContext(got); sc.TraceID() != span.SpanContext().TraceID() || sc.SpanID() != span.SpanContext().SpanID() {
		t.Errorf("extracted span context %v, want %v", sc, span.SpanContext())
	}
	if v := baggage.FromContext(got).Member("tenant").Value(); v != "acme" {
		t.Errorf("extracted baggage tenant = %q, want acme", v)
	}

	// No span in ctx: nothing is written.
	h = map[string]string{}
	otelonceflow.NewInjector().InjectHeaders(context.Background(), h)
	if len(h) != 0 {
		t.Errorf("injector without a span wrote %v", h)
	}
}

func TestHTTPHookRecordsTheOutcomeOnTheRequestSpan(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	for _, o := range []idempotency.Outcome{idempotency.OutcomeClaimed, idempotency.OutcomeReplayed, idempotency.OutcomeConflict, idempotency.OutcomeMismatch} {
		ctx, span := tp.Tracer("t").Start(context.Background(), o.String())
		otelonceflow.NewHTTPHook().OnRequest(ctx, idempotency.RequestEvent{Outcome: o, Mode: idempotency.Leased, Key: "k"})
		span.End()
	}
	// Without a span, nothing happens (and nothing panics).
	otelonceflow.NewHTTPHook().OnRequest(context.Background(), idempotency.RequestEvent{Outcome: idempotency.OutcomeClaimed})
	spans := rec.Ended()
	if len(spans) != 4 {
		t.Fatalf("%d spans, want 4", len(spans))
	}
	for _, s := range spans {
		got := map[string]string{}
		for _, kv := range s.Attributes() {
			got[string(kv.Key)] = kv.Value.String()
		}
		if got["onceflow.idempotency.outcome"] != s.Name() || got["onceflow.idempotency.mode"] != idempotency.Leased.String() {
			t.Errorf("span %s attributes %v", s.Name(), got)
		}
	}
}
