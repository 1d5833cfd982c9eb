package otelonceflow

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/relay"
)

// AttrOutboxDwell is the time, in seconds, a published event spent in the
// outbox: from its write to Kafka's acknowledgement.
const AttrOutboxDwell = attribute.Key("onceflow.outbox.dwell_seconds")

// RelayObserver is a relay.Observer that adds, for each published event
// whose headers carry a trace context, a producer span "send <topic>", a
// child of the producer's span in the producer's trace, from the start of
// the attempt that published it (its round, or the side retry of an event
// not acknowledged within relay.Config.PublishTimeout) to Kafka's
// acknowledgement, with onceflow.outbox.dwell_seconds.
// The span honours the producer's sampling decision: with a
// parent-based sampler (the SDK's default, and what OTEL_TRACES_SAMPLER's
// parentbased_* values give) it is recorded and exported if and only if
// the producer's trace was sampled (traceparent flags 01), whatever ratio
// the relay's own sampler applies to new traces. The span may start and
// end after the producer's span ended (the event waited in the outbox):
// trace viewers show it as the later hop it is.
// Events without a trace context get no span. It passes every call on to
// the Observer it wraps (relayprom's, say); sick-partition changes only
// to one that is a relay.SickPartitionObserver, and BatchStats tells the
// wrapped Observer SickPartitionsReported only then. Set it as
// relay.Config.Observer. Safe for concurrent use.
type RelayObserver struct {
	next       relay.Observer
	nextEvents relay.EventObserver
	nextSick   relay.SickPartitionObserver
	tracer     trace.Tracer
	propagator propagation.TextMapPropagator
}

var (
	_ relay.Observer              = (*RelayObserver)(nil)
	_ relay.EventObserver         = (*RelayObserver)(nil)
	_ relay.SickPartitionObserver = (*RelayObserver)(nil)
)

// NewRelayObserver wraps next, which may be nil.
func NewRelayObserver(next relay.Observer, opts ...Option) *RelayObserver {
	c := newConfig(opts)
	o := &RelayObserver{next: next, tracer: c.provider.Tracer(instrumentationName), propagator: c.propagator}
	o.nextEvents, _ = next.(relay.EventObserver)
	o.nextSick, _ = next.(relay.SickPartitionObserver)
	return o
}

// ObserveBatch implements relay.Observer. SickPartitionsReported says the
// relay reports sick-partition changes to o; next hears of it only if o
// passes them on, that is, if next is a relay.SickPartitionObserver.
func (o *RelayObserver) ObserveBatch(s relay.BatchStats) {
	if o.next != nil {
		s.SickPartitionsReported = s.SickPartitionsReported && o.nextSick != nil
		o.next.ObserveBatch(s)
	}
}

// ObserveShards implements relay.Observer.
func (o *RelayObserver) ObserveShards(owned int) {
	if o.next != nil {
		o.next.ObserveShards(owned)
	}
}

// SickPartitionsChanged implements relay.SickPartitionObserver: relayprom's
// onceflow_relay_sick_partitions follows these calls.
func (o *RelayObserver) SickPartitionsChanged(delta int) {
	if o.nextSick != nil {
		o.nextSick.SickPartitionsChanged(delta)
	}
}

// ObservePublished implements relay.EventObserver.
func (o *RelayObserver) ObservePublished(e relay.PublishedEvent) {
	if o.nextEvents != nil {
		o.nextEvents.ObservePublished(e)
	}
	producer := o.propagator.Extract(context.Background(), propagation.MapCarrier(e.Headers))
	if !trace.SpanContextFromContext(producer).IsValid() {
		return
	}
	// A child of the producer's span, so the sampler (ParentBased, the
	// SDK's default) follows the producer's decision.
	_, span := o.tracer.Start(producer, "send "+e.Topic,
		trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithTimestamp(e.PublishStart),
		trace.WithAttributes(
			semconv.MessagingSystemKafka,
			semconv.MessagingOperationTypeSend,
			semconv.MessagingOperationName("send"),
			semconv.MessagingDestinationName(e.Topic),
			semconv.MessagingMessageID(e.EventID),
			AttrOutboxDwell.Float64(max(e.Acked.Sub(e.CreatedAt), 0).Seconds()),
		))
	span.End(trace.WithTimestamp(e.Acked))
}
