package otelonceflow_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/otelonceflow"
)

// In batch mode each message's consumer span covers the batch's
// transaction: it lasts at least as long as the handler's work and is a
// child of its own producer's span; a duplicate within the batch is marked
// as one.
func TestBatchConsumerSpansCoverTheBatchTransaction(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	schema := pgtest.Schema(t)

	const work = 100 * time.Millisecond
	// A first batch of one warm-up message holds the partition until the
	// three are queued, so they make one batch: queued one by one, the
	// first could otherwise go alone (seen under load in CI).
	warming, release := make(chan struct{}), make(chan struct{})
	p, err := consumer.NewBatch(pgtest.Pool(t), "shipping", func(ctx context.Context, tx pgx.Tx, ms []consumer.Message) error {
		if ms[0].Topic == "warmup" {
			close(warming)
			<-release
			return nil
		}
		time.Sleep(work) // the handler's work, of known length
		_, err := tx.Exec(ctx, `SELECT 1`)
		return err
	}, &consumer.Config{Schema: schema, Hooks: []consumer.Hook{otelonceflow.NewConsumer(otelonceflow.WithTracerProvider(tp))}})
	if err != nil {
		t.Fatal(err)
	}

	// Three messages from three requests; the third repeats the first's id.
	var producers []trace.SpanContext
	var msgs []consumer.Message
	for i := range 3 {
		ctx, span := tp.Tracer("t").Start(context.Background(), "request")
		span.End()
		h := map[string]string{}
		otelonceflow.NewInjector().InjectHeaders(ctx, h)
		id := "id-" + strconv.Itoa(i%2)
		m := consumer.Message{Topic: "orders", Offset: int64(i + 1), Key: []byte("k"), Value: []byte("v"),
			Headers: []consumer.Header{{Key: "message-id", Value: []byte(id)}, {Key: "traceparent", Value: []byte(h["traceparent"])}}}
		producers, msgs = append(producers, span.SpanContext()), append(msgs, m)
	}
	tr := &marks{}
	ctx := context.Background()
	w := p.StartPartition(ctx, tr)
	defer w.Stop(ctx)
	if err := w.Add(ctx, consumer.Message{Topic: "warmup", Offset: 0, Headers: []consumer.Header{{Key: "message-id", Value: []byte("warmup")}}}); err != nil {
		t.Fatal(err)
	}
	<-warming
	if err := w.Add(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
	close(release)
	waitUntil(t, 30*time.Second, "the batch to be processed", func() bool { return tr.last() == 3 })

	spans := map[trace.SpanID]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		if s.Name() == "process orders" {
			spans[s.Parent().SpanID()] = s
		}
	}
	if len(spans) != 3 {
		t.Fatalf("%d consumer spans, want 3", len(spans))
	}
	for i, producer := range producers {
		s := spans[producer.SpanID()]
		if s == nil || s.SpanContext().TraceID() != producer.TraceID() {
			t.Errorf("message %d: no consumer span child of its producer's span", i)
			continue
		}
		if d := s.EndTime().Sub(s.StartTime()); d < work {
			t.Errorf("message %d: consumer span lasted %s, less than the batch handler's %s", i, d, work)
		}
		want := "false"
		if i == 2 {
			want = "true"
		}
		if got := attrOf(s, "onceflow.duplicate"); got != want {
			t.Errorf("message %d: onceflow.duplicate = %s, want %s", i, got, want)
		}
		if got := attrOf(s, "onceflow.batch.size"); got != "3" {
			t.Errorf("message %d: onceflow.batch.size = %q, want 3", i, got)
		}
	}
}

// A message whose handler failed once and then committed shows as retried
// on its consumer span, with a "retry" event for the failed attempt.
func TestConsumerSpanRecordsARetry(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	failed := false
	p, err := consumer.New(pgtest.Pool(t), "shipping", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if !failed {
			failed = true
			return errors.New("transient")
		}
		return nil
	}, &consumer.Config{Schema: pgtest.Schema(t), MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond,
		Hooks: []consumer.Hook{otelonceflow.NewConsumer(otelonceflow.WithTracerProvider(tp))}})
	if err != nil {
		t.Fatal(err)
	}
	processOne(t, p, idHeader("id-0"))
	spans := rec.Ended()
	if len(spans) != 1 {
		t.Fatalf("%d spans, want 1", len(spans))
	}
	s := spans[0]
	if attrOf(s, "onceflow.retried") != "true" || attrOf(s, "onceflow.attempts") != "2" || attrOf(s, "onceflow.outcome") != "processed" {
		t.Errorf("span attributes %v: want processed, retried, 2 attempts", s.Attributes())
	}
	if len(s.Events()) != 1 || s.Events()[0].Name != "retry" {
		t.Errorf("span events %v: want one retry", s.Events())
	}
}

// processOne runs one message (offset 0 of "orders") with headers through
// p on a partition of its own, and waits until it is finished.
func processOne(t *testing.T, p *consumer.Processor, headers []consumer.Header) {
	t.Helper()
	processOneUnder(t, context.Background(), p, headers)
}

// processOneUnder is processOne with the partition started under ctx, as
// an adapter's Run starts it under its own.
func processOneUnder(t *testing.T, ctx context.Context, p *consumer.Processor, headers []consumer.Header) {
	t.Helper()
	tr := &marks{}
	w := p.StartPartition(ctx, tr)
	defer w.Stop(ctx)
	if err := w.Add(ctx, consumer.Message{Topic: "orders", Value: []byte("v"), Headers: headers}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 30*time.Second, "the message to finish", func() bool { return tr.last() == 0 })
}

// idHeader is the headers of a message with id.
func idHeader(id string) []consumer.Header {
	return []consumer.Header{{Key: "message-id", Value: []byte(id)}}
}

// marks is a consumer.Transport that records the last offset marked done.
type marks struct {
	mu     sync.Mutex
	offset int64
	any    bool
}

func (m *marks) MarkDone(msg consumer.Message) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.offset, m.any = msg.Offset, true
}

func (m *marks) PublishDeadLetter(context.Context, consumer.DeadLetter) error { return nil }

func (m *marks) last() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.any {
		return -1
	}
	return m.offset
}
