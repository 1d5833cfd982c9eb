package otelonceflow_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/otelonceflow"
)

// A message without a trace context starts a trace of its own. Its span
// was a child of whatever span the Processor's context held (an adapter's
// Run started under a start-up span, say), so every such message piled
// into that one long trace.
func TestConsumerSpanWithoutTraceContextIsARoot(t *testing.T) {
	t.Parallel()
	for _, batch := range []bool{false, true} {
		name := "per-message"
		if batch {
			name = "batch"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			rec := tracetest.NewSpanRecorder()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
			defer func() { _ = tp.Shutdown(context.Background()) }()
			cfg := &consumer.Config{Schema: pgtest.Schema(t), Hooks: []consumer.Hook{otelonceflow.NewConsumer(otelonceflow.WithTracerProvider(tp))}}
			var p *consumer.Processor
			var err error
			if batch {
				p, err = consumer.NewBatch(pgtest.Pool(t), "shipping", func(context.Context, pgx.Tx, []consumer.Message) error { return nil }, cfg)
			} else {
				p, err = consumer.New(pgtest.Pool(t), "shipping", func(context.Context, pgx.Tx, consumer.Message) error { return nil }, cfg)
			}
			if err != nil {
				t.Fatal(err)
			}
			ctx, startup := tp.Tracer("t").Start(context.Background(), "start-up")
			defer startup.End()
			processOneUnder(t, ctx, p, idHeader("no-trace"))
			spans := rec.Ended()
			if len(spans) != 1 || spans[0].Name() != "process orders" {
				t.Fatalf("%d spans ended, want the message's one", len(spans))
			}
			s := spans[0]
			if s.Parent().IsValid() || s.SpanContext().TraceID() == startup.SpanContext().TraceID() {
				t.Errorf("span of a message without trace headers has parent %s in trace %s; want a root, not a child of the Processor's span %s",
					s.Parent().SpanID(), s.SpanContext().TraceID(), startup.SpanContext().SpanID())
			}
		})
	}
}

// In batch mode a batch retried whole after a serialization conflict is
// retried between its messages' traces (each ended, abandoned, with the
// failed attempt), so the retry hook had only the Processor's context and
// put a "retry" event, with the error's text, on whatever span that held.
func TestBatchConflictRetryLeavesTheProcessorsSpanAlone(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	conflicted := false
	p, err := consumer.NewBatch(pgtest.Pool(t), "shipping", func(context.Context, pgx.Tx, []consumer.Message) error {
		if !conflicted {
			conflicted = true
			return &pgconn.PgError{Code: "40001", Message: "could not serialize access due to concurrent update"}
		}
		return nil
	}, &consumer.Config{Schema: pgtest.Schema(t), MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond,
		Hooks: []consumer.Hook{otelonceflow.NewConsumer(otelonceflow.WithTracerProvider(tp))}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, startup := tp.Tracer("t").Start(context.Background(), "start-up")
	processOneUnder(t, ctx, p, idHeader("conflicted"))
	startup.End()
	if !conflicted {
		t.Fatal("the batch handler never ran")
	}
	for _, s := range rec.Ended() {
		if s.SpanContext().SpanID() != startup.SpanContext().SpanID() {
			continue
		}
		for _, e := range s.Events() {
			if e.Name == "retry" {
				t.Errorf("the Processor's span got a retry event %v from a batch's conflict", e.Attributes)
			}
		}
	}
}

// remoteParentHook is a HookTrace before otelonceflow's that found the
// message's trace in headers of another format (B3, say) and put it in the
// context as a remote parent, as a propagator would.
type remoteParentHook struct{ parent trace.SpanContext }

func (h remoteParentHook) TraceStart(ctx context.Context, _ consumer.TraceStartEvent) context.Context {
	return trace.ContextWithRemoteSpanContext(ctx, h.parent)
}
func (remoteParentHook) TraceRetry(context.Context, consumer.RetryEvent)  {}
func (remoteParentHook) TraceEnd(context.Context, consumer.TraceEndEvent) {}

// helper 117: clearing the context's span for a message without trace
// headers also dropped a remote parent put there on purpose by an earlier
// hook: only a local span (the Processor's own context's) is left out.
func TestConsumerSpanKeepsARemoteParentFromAnEarlierHook(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	parent := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5, 6},
		TraceFlags: trace.FlagsSampled, Remote: true})
	cfg := &consumer.Config{Schema: pgtest.Schema(t), Hooks: []consumer.Hook{remoteParentHook{parent}, otelonceflow.NewConsumer(otelonceflow.WithTracerProvider(tp))}}
	p, err := consumer.New(pgtest.Pool(t), "shipping", func(context.Context, pgx.Tx, consumer.Message) error { return nil }, cfg)
	if err != nil {
		t.Fatal(err)
	}
	processOneUnder(t, context.Background(), p, idHeader("b3-traced"))
	spans := rec.Ended()
	if len(spans) != 1 {
		t.Fatalf("%d spans ended, want the message's one", len(spans))
	}
	if got := spans[0].Parent(); got.TraceID() != parent.TraceID() || got.SpanID() != parent.SpanID() {
		t.Fatalf("span's parent is %s/%s, want the earlier hook's remote parent %s/%s", got.TraceID(), got.SpanID(), parent.TraceID(), parent.SpanID())
	}
}
