package otelonceflow_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/otelonceflow"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
	"github.com/onceflow/onceflow/relay/relayprom"
)

// An event not acknowledged within the publish timeout is retried beside
// the rounds (the side retry) until its partition heals; when it is finally
// published it gets the same producer span as a round's event (a child of
// the request's span, with its outbox dwell time) and its dwell time is
// observed by the binary's histogram.
func TestSideRetriedEventIsTracedAndItsDwellObserved(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()

	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	k := kafkatest.New(t)
	fake := k.RequireFake(t)
	topic := k.Topic(t, 1)
	sick := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.NotEnoughReplicas, Count: -1})

	// The request writes its event under its span.
	w, err := outbox.NewWriter(&outbox.Config{Schema: schema, Inject: otelonceflow.NewInjector()})
	if err != nil {
		t.Fatal(err)
	}
	reqCtx, request := tp.Tracer("t").Start(ctx, "request")
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return w.Write(reqCtx, tx, outbox.Message{Topic: topic, Key: []byte("k"), Value: []byte("held")})
	}); err != nil {
		t.Fatal(err)
	}
	request.End()

	pub, err := kgopublisher.New(k.Brokers, &kgopublisher.Config{Opts: []kgo.Opt{
		kgo.MetadataMinAge(50 * time.Millisecond),
		kgo.RetryBackoffFn(func(int) time.Duration { return 20 * time.Millisecond }),
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	reg := prometheus.NewRegistry()
	const publishTimeout = time.Second
	r, err := relay.New(pool, pub, &relay.Config{Schema: schema, PollInterval: 50 * time.Millisecond, PublishTimeout: publishTimeout,
		Observer: otelonceflow.NewRelayObserver(relayprom.NewObserver(reg), otelonceflow.WithTracerProvider(tp))})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("relay.Run: %v", err)
		}
	}()

	// The round times out, then the side retry does too at least once.
	outboxTable := pgx.Identifier{schema, "outbox"}.Sanitize()
	waitUntil(t, 60*time.Second, "the event to be retried beside the rounds", func() bool {
		var attempts int
		err := pool.QueryRow(ctx, `SELECT attempts FROM `+outboxTable).Scan(&attempts)
		return err == nil && attempts >= 2
	})
	if n := sendSpans(rec, topic); len(n) != 0 {
		t.Fatalf("%d send spans before the event was published", len(n))
	}
	sick.Remove()
	waitUntil(t, 60*time.Second, "the outbox to drain", func() bool {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM `+outboxTable).Scan(&n)
		return err == nil && n == 0
	})
	if got := k.ReadAll(t, topic, 1, 30*time.Second); len(got) != 1 || string(got[0].Value) != "held" {
		t.Fatalf("read %d records, want the held event", len(got))
	}

	spans := sendSpans(rec, topic)
	if len(spans) != 1 {
		t.Fatalf("%d send spans for the side-retried event, want 1", len(spans))
	}
	send := spans[0]
	if send.Parent().SpanID() != request.SpanContext().SpanID() ||
		send.SpanContext().TraceID() != request.SpanContext().TraceID() || send.SpanKind() != trace.SpanKindProducer {
		t.Errorf("send span %s (kind %v, parent %v): want a producer span, child of the request's span %v",
			send.Name(), send.SpanKind(), send.Parent(), request.SpanContext())
	}
	dwell, err := strconv.ParseFloat(attrOf(send, string(otelonceflow.AttrOutboxDwell)), 64)
	if err != nil || dwell < publishTimeout.Seconds() {
		t.Errorf("send span dwell %v (%v): want at least the publish timeout it waited out, %s", dwell, err, publishTimeout)
	}
	if n := dwellCount(t, reg); n != 1 {
		t.Errorf("onceflow_outbox_dwell_seconds counted %d events, want 1", n)
	}
}

func sendSpans(rec *tracetest.SpanRecorder, topic string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "send "+topic {
			out = append(out, s)
		}
	}
	return out
}

// dwellCount returns how many events onceflow_outbox_dwell_seconds observed.
func dwellCount(t *testing.T, reg *prometheus.Registry) uint64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "onceflow_outbox_dwell_seconds" {
			var n uint64
			for _, m := range mf.GetMetric() {
				n += m.GetHistogram().GetSampleCount()
			}
			return n
		}
	}
	return 0
}

func attrOf(s sdktrace.ReadOnlySpan, key string) string {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value.String()
		}
	}
	return ""
}

func waitUntil(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
