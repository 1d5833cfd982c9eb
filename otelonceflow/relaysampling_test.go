package otelonceflow_test

import (
	"context"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/otelonceflow"
	"github.com/onceflow/onceflow/relay"
)

// The relay's send span honours the producer's sampling decision: it
// appears in the producer's trace, a child of the producer's span, if and
// only if that trace is sampled. It was a new root linked to the producer's
// span, so the relay's sampler decided on a fresh trace id: with the
// default sampler (parentbased_always_on, what onceflow relay gets from
// OTEL_EXPORTER_OTLP_ENDPOINT alone) every event of an unsampled trace got
// an exported span, and under parentbased_traceidratio 0.1 nine in ten
// sampled traces lost their relay hop.
func TestRelaySpanHonoursTheProducersSamplingDecision(t *testing.T) {
	t.Parallel()
	const producerTrace, producerSpan = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
	for _, tc := range []struct {
		name    string
		sampler sdktrace.Sampler
		flags   string
		want    int
	}{
		{"unsampled, default sampler", nil, "00", 0},
		{"sampled, default sampler", nil, "01", 100},
		{"unsampled, ratio sampler", sdktrace.ParentBased(sdktrace.TraceIDRatioBased(0.1)), "00", 0},
		{"sampled, ratio sampler", sdktrace.ParentBased(sdktrace.TraceIDRatioBased(0.1)), "01", 100},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rec := tracetest.NewSpanRecorder()
			opts := []sdktrace.TracerProviderOption{sdktrace.WithSpanProcessor(rec)}
			if tc.sampler != nil {
				opts = append(opts, sdktrace.WithSampler(tc.sampler))
			}
			tp := sdktrace.NewTracerProvider(opts...)
			defer func() { _ = tp.Shutdown(context.Background()) }()
			o := otelonceflow.NewRelayObserver(nil, otelonceflow.WithTracerProvider(tp))
			now := time.Now()
			for range 100 {
				o.ObservePublished(relay.PublishedEvent{EventID: "e", Topic: "orders",
					Headers:   map[string]string{"traceparent": "00-" + producerTrace + "-" + producerSpan + "-" + tc.flags},
					CreatedAt: now, Acked: now, PublishStart: now})
			}
			sampled, wrong := 0, 0
			for _, s := range rec.Ended() {
				if !s.SpanContext().IsSampled() {
					continue
				}
				sampled++
				if s.SpanContext().TraceID().String() != producerTrace || s.Parent().SpanID().String() != producerSpan ||
					!s.Parent().IsRemote() || s.SpanKind() != trace.SpanKindProducer {
					if wrong++; wrong == 1 {
						t.Errorf("send span in trace %s, parent %s, kind %v: want a producer span, child of the producer's span %s in trace %s",
							s.SpanContext().TraceID(), s.Parent().SpanID(), s.SpanKind(), producerSpan, producerTrace)
					}
				}
			}
			if sampled != tc.want {
				t.Errorf("%d of 100 events of a producer trace with flags %s got a sampled relay span; want %d", sampled, tc.flags, tc.want)
			}
		})
	}
}
