package otelonceflow

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/outbox"
)

// instrumentationName names the tracer of this package's spans.
const instrumentationName = "github.com/onceflow/onceflow/otelonceflow"

// Option configures an Injector, a Consumer or an HTTPHook.
type Option func(*config)

type config struct {
	provider   trace.TracerProvider
	propagator propagation.TextMapPropagator
	group      string
	recordKeys bool
}

func newConfig(opts []Option) config {
	c := config{propagator: propagation.TraceContext{}, recordKeys: true}
	for _, o := range opts {
		o(&c)
	}
	if c.provider == nil {
		c.provider = otel.GetTracerProvider()
	}
	return c
}

// WithTracerProvider sets where spans go. Defaults to the global provider
// (otel.GetTracerProvider), read when the Consumer is made.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(c *config) { c.provider = tp }
}

// WithPropagator sets how the trace context is written into and read from
// headers. Defaults to the W3C Trace Context propagator (traceparent,
// tracestate); pass
// propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
// to carry W3C baggage too. Use the same propagator on both sides.
func WithPropagator(p propagation.TextMapPropagator) Option {
	return func(c *config) { c.propagator = p }
}

// WithConsumerGroup sets messaging.consumer.group.name on consumer spans.
// Defaults to the consumer's name (consumer.New's name), which is the
// Kafka group name when the adapter was given the same one.
func WithConsumerGroup(group string) Option {
	return func(c *config) { c.group = group }
}

// WithoutMessageKeys leaves messaging.kafka.message.key out of consumer
// spans, for keys that should not leave the service. Defaults to recording
// keys.
func WithoutMessageKeys() Option {
	return func(c *config) { c.recordKeys = false }
}

// Injector writes the trace context of outbox.Write's ctx into each event's
// headers; set it as outbox.Config.Inject. Safe for concurrent use.
type Injector struct {
	propagator propagation.TextMapPropagator
}

var _ outbox.Injector = (*Injector)(nil)

// NewInjector returns an Injector. Only WithPropagator applies.
func NewInjector(opts ...Option) *Injector {
	c := newConfig(opts)
	return &Injector{propagator: c.propagator}
}

// InjectHeaders implements outbox.Injector: with a valid span in ctx it
// sets traceparent (and tracestate, and baggage when the propagator carries
// it); with none it sets nothing.
func (i *Injector) InjectHeaders(ctx context.Context, h map[string]string) {
	i.propagator.Inject(ctx, propagation.MapCarrier(h))
}

// headerCarrier reads a consumer.Message's headers for a propagator.
type headerCarrier []consumer.Header

func (hc headerCarrier) Get(key string) string {
	for i := len(hc) - 1; i >= 0; i-- {
		if hc[i].Key == key {
			return string(hc[i].Value)
		}
	}
	return ""
}

func (hc headerCarrier) Set(string, string) {}

func (hc headerCarrier) Keys() []string {
	keys := make([]string, len(hc))
	for i, h := range hc {
		keys[i] = h.Key
	}
	return keys
}

// Extract returns ctx with the trace context (and baggage, with such a
// propagator) carried by msg's headers, for code that reads messages
// without a Processor. Only WithPropagator applies.
func Extract(ctx context.Context, msg consumer.Message, opts ...Option) context.Context {
	c := newConfig(opts)
	return c.propagator.Extract(ctx, headerCarrier(msg.Headers))
}
