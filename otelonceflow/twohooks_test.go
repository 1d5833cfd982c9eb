package otelonceflow_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/otelonceflow"
)

// Two trace hooks (two providers, or otelonceflow beside a tracing hook of
// the user's): every hook got the last hook's context in TraceRetry and
// TraceEnd, so the first hook's span was never ended (leaked, never
// exported) and the last one's was ended twice. Each hook now gets the
// context its own TraceStart returned, in both modes.
func TestTwoTraceHooksEachEndTheirOwnSpan(t *testing.T) {
	t.Parallel()
	for _, batch := range []bool{false, true} {
		name := "per-message"
		if batch {
			name = "batch"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			recA, recB := tracetest.NewSpanRecorder(), tracetest.NewSpanRecorder()
			tpA := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(recA))
			tpB := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(recB))
			cfg := &consumer.Config{Schema: pgtest.Schema(t), MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond,
				Hooks: []consumer.Hook{
					otelonceflow.NewConsumer(otelonceflow.WithTracerProvider(tpA)),
					otelonceflow.NewConsumer(otelonceflow.WithTracerProvider(tpB)),
				}}
			failed := false
			fail := func() error { // the first attempt fails: a retry event on each span
				if !failed {
					failed = true
					return errors.New("transient")
				}
				return nil
			}
			var p *consumer.Processor
			var err error
			if batch {
				p, err = consumer.NewBatch(pgtest.Pool(t), "shipping", func(context.Context, pgx.Tx, []consumer.Message) error { return fail() }, cfg)
			} else {
				p, err = consumer.New(pgtest.Pool(t), "shipping", func(context.Context, pgx.Tx, consumer.Message) error { return fail() }, cfg)
			}
			if err != nil {
				t.Fatal(err)
			}
			processOne(t, p, idHeader("two-hooks"))
			for _, r := range []struct {
				name string
				rec  *tracetest.SpanRecorder
			}{{"A", recA}, {"B", recB}} {
				started, ended := len(r.rec.Started()), len(r.rec.Ended())
				if started == 0 || ended != started {
					t.Errorf("provider %s: %d spans started, %d ended; want every span ended once", r.name, started, ended)
					continue
				}
				last := r.rec.Ended()[ended-1]
				// In batch mode the failed batch's spans end abandoned and
				// the message runs alone, in a span of its own, at once.
				wantEvents := 1
				if batch {
					wantEvents = 0
				}
				if attrOf(last, "onceflow.outcome") != "processed" || len(last.Events()) != wantEvents {
					t.Errorf("provider %s: last span outcome %q with %d events; want processed, %d retry events",
						r.name, attrOf(last, "onceflow.outcome"), len(last.Events()), wantEvents)
				}
			}
		})
	}
}
