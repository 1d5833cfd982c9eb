package otelonceflow

import (
	"context"
	"errors"
	"reflect"
	"strconv"
	"strings"
	"unicode/utf8"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/consumer"
)

// Attributes this package sets beside OpenTelemetry's semantic conventions.
const (
	// AttrConsumer is the consumer name deduplication is scoped to.
	AttrConsumer = attribute.Key("onceflow.consumer")
	// AttrOutcome is how the message left the Processor: processed,
	// duplicate, dead-lettered, or abandoned (shutdown or lost partition;
	// it is processed again later).
	AttrOutcome = attribute.Key("onceflow.outcome")
	// AttrDuplicate is true when the message was already processed and its
	// handler did not run.
	AttrDuplicate = attribute.Key("onceflow.duplicate")
	// AttrAttempts is how many times the handler ran for the message.
	AttrAttempts = attribute.Key("onceflow.attempts")
	// AttrRetried is true when an attempt failed and was retried (the
	// span has a "retry" event), whether the handler had run or not: a
	// database that could not be reached, a connection lost at COMMIT.
	AttrRetried = attribute.Key("onceflow.retried")
	// AttrDeadLetterTopic is the topic a dead-lettered message went to.
	AttrDeadLetterTopic = attribute.Key("onceflow.dead_letter.topic")
	// AttrBatchSize is the size of the batch transaction that finished
	// the message, when above 1.
	AttrBatchSize = attribute.Key("onceflow.batch.size")
)

// Consumer is a consumer.HookTrace: put it in consumer.Config.Hooks. For
// each message it starts a consumer span "process <topic>" whose parent is
// the producer's span carried in the record's headers (a message without
// one starts a trace of its own, whatever span the Processor's context
// holds), runs the handler's transaction inside it (the handler's ctx holds
// the span), and ends it with the outcome. In batch mode
// (consumer.NewBatch) each message's span covers the batch's transaction,
// from before BEGIN to after COMMIT, with onceflow.batch.size; the
// BatchHandler's ctx holds none of them, since a batch's messages belong to
// many traces. It follows OpenTelemetry's messaging conventions:
// messaging.system=kafka, messaging.operation.type=process,
// messaging.destination.name, messaging.destination.partition.id,
// messaging.kafka.message.key, messaging.kafka.offset,
// messaging.consumer.group.name, messaging.message.id; and adds the
// onceflow.* attributes above. A retry adds a "retry" event. A dead letter
// sets the span's status to Error and error.type to the type of the
// handler's error (or ErrorTypeNoMessageID), and records the error; an
// abandoned message's span gets status Error and error.type
// ErrorTypeAbandoned. Error text on a span (the retry event's
// error.message, the recorded error, the status) is cut at 8 KiB, as the
// consumer cuts its dead letter's error header: a handler's error may carry
// a whole payload. Safe for concurrent use.
type Consumer struct {
	tracer     trace.Tracer
	propagator propagation.TextMapPropagator
	group      string
	recordKeys bool
}

var _ consumer.HookTrace = (*Consumer)(nil)

// NewConsumer returns a Consumer hook.
func NewConsumer(opts ...Option) *Consumer {
	c := newConfig(opts)
	return &Consumer{
		tracer:     c.provider.Tracer(instrumentationName),
		propagator: c.propagator,
		group:      c.group,
		recordKeys: c.recordKeys,
	}
}

// TraceStart implements consumer.HookTrace. The span's parent is the
// producer's span from the message's headers, else a remote parent an
// earlier hook put in ctx, never a local span ctx holds: a message without
// a trace context starts a trace of its own.
func (c *Consumer) TraceStart(ctx context.Context, e consumer.TraceStartEvent) context.Context {
	// The W3C propagator returns ctx as it is when the headers carry no
	// traceparent, which would make the span a child of the Processor's
	// (an adapter's Run under a start-up span, say). A remote parent an
	// earlier hook extracted (another header format) is kept.
	if !trace.SpanContextFromContext(ctx).IsRemote() {
		ctx = trace.ContextWithSpanContext(ctx, trace.SpanContext{})
	}
	ctx = c.propagator.Extract(ctx, headerCarrier(e.Message.Headers))
	group := c.group
	if group == "" {
		group = e.Consumer
	}
	attrs := make([]attribute.KeyValue, 0, 10)
	attrs = append(attrs,
		semconv.MessagingSystemKafka,
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		semconv.MessagingDestinationName(e.Message.Topic),
		semconv.MessagingDestinationPartitionID(strconv.Itoa(int(e.Message.Partition))),
		semconv.MessagingKafkaOffset(int(e.Message.Offset)),
		semconv.MessagingConsumerGroupName(group),
		AttrConsumer.String(e.Consumer),
	)
	if c.recordKeys && e.Message.Key != nil && utf8.Valid(e.Message.Key) {
		attrs = append(attrs, semconv.MessagingKafkaMessageKey(string(e.Message.Key)))
	}
	ctx, _ = c.tracer.Start(ctx, "process "+e.Message.Topic,
		trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
	return ctx
}

// TraceRetry implements consumer.HookTrace.
func (c *Consumer) TraceRetry(ctx context.Context, e consumer.RetryEvent) {
	span := trace.SpanFromContext(ctx)
	span.AddEvent("retry", trace.WithAttributes(
		AttrAttempts.Int(e.Attempt),
		attribute.String("error.message", errorText(e.Err)),
		attribute.Float64("onceflow.backoff_seconds", e.Backoff.Seconds()),
	))
}

// TraceEnd implements consumer.HookTrace.
func (c *Consumer) TraceEnd(ctx context.Context, e consumer.TraceEndEvent) {
	span := trace.SpanFromContext(ctx)
	outcome := "abandoned"
	if e.Outcome != 0 {
		outcome = e.Outcome.String()
	}
	attrs := make([]attribute.KeyValue, 0, 7)
	attrs = append(attrs,
		AttrOutcome.String(outcome),
		AttrDuplicate.Bool(e.Outcome == consumer.Duplicate),
		AttrAttempts.Int(e.Attempts),
		AttrRetried.Bool(e.Retries > 0),
	)
	if e.Message.ID != "" {
		attrs = append(attrs, semconv.MessagingMessageID(e.Message.ID))
	}
	if e.BatchSize > 1 {
		attrs = append(attrs, AttrBatchSize.Int(e.BatchSize))
	}
	if e.Outcome == consumer.DeadLettered {
		attrs = append(attrs, AttrDeadLetterTopic.String(e.DeadLetterTopic))
	}
	span.SetAttributes(attrs...)
	switch {
	case e.Outcome == consumer.DeadLettered:
		span.SetAttributes(errorType(e.Err))
		if e.Err != nil {
			recordError(span, e.Err)
			span.SetStatus(codes.Error, "dead-lettered: "+errorText(e.Err))
		} else {
			span.SetStatus(codes.Error, "dead-lettered")
		}
	case e.Outcome == 0 && e.Err != nil:
		span.SetAttributes(semconv.ErrorTypeKey.String(ErrorTypeAbandoned))
		span.SetStatus(codes.Error, "abandoned: "+errorText(e.Err))
	}
	span.End()
}

// error.type values of this package's own, for failures that are not an
// error of a type of their own.
const (
	// ErrorTypeNoMessageID is a message dead-lettered for want of a
	// usable id (consumer.ErrNoMessageID).
	ErrorTypeNoMessageID = "onceflow.no_message_id"
	// ErrorTypeAbandoned is a message left unfinished (shutdown, lost
	// partition, a failed batch's message then processed alone), which is
	// processed again.
	ErrorTypeAbandoned = "onceflow.abandoned"
)

// errorType is the error.type of a dead-lettered message's span: the type
// of the handler's error (see semconv.ErrorType; consumer.Permanent is a
// marker, so the type it wraps), ErrorTypeNoMessageID, or _OTHER when
// there is no error.
func errorType(err error) attribute.KeyValue {
	if errors.Is(err, consumer.ErrNoMessageID) {
		return semconv.ErrorTypeKey.String(ErrorTypeNoMessageID)
	}
	var pe *consumer.PermanentError
	if errors.As(err, &pe) && pe.Err != nil {
		err = pe.Err
	}
	return semconv.ErrorType(err)
}

// maxErrorText bounds the error text put on a span, as the consumer bounds
// its dead letter's error header: a handler's error may carry a whole
// payload, and a span of megabytes (one copy a retry) can get its OTLP
// export batch rejected.
const maxErrorText = 8 << 10

// errorText is err's text, cut at maxErrorText bytes to valid UTF-8 the
// way the consumer cuts its dead letter's error header.
func errorText(err error) string {
	s := err.Error()
	if len(s) <= maxErrorText {
		return s
	}
	return strings.ToValidUTF8(s[:maxErrorText], "") + "... (cut at 8 KiB)"
}

// recordError is span.RecordError(err), the exception event with the
// SDK's exception.type, with err's text cut by errorText.
func recordError(span trace.Span, err error) {
	if !span.IsRecording() {
		return
	}
	t := reflect.TypeOf(err)
	typ := t.String() // a builtin type, or one without a name
	if t.PkgPath() != "" || t.Name() != "" {
		typ = t.PkgPath() + "." + t.Name()
	}
	span.AddEvent(semconv.ExceptionEventName, trace.WithAttributes(
		semconv.ExceptionType(typ),
		semconv.ExceptionMessage(errorText(err)),
	))
}
