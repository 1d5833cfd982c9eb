package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/examples/internal/exampletest"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/otelonceflow"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
	"github.com/onceflow/onceflow/relay/relayprom"
)

// One trace from the HTTP request to the consumer's commit: POST /orders
// through the orders service's own handler (otelhttp, the idempotency
// middleware with otelonceflow's hook, the outbox writer with its
// injector), the relay publishing to Kafka, and an idempotent consumer with
// otelonceflow's tracer applying the event. A redelivered record shows as a
// duplicate in the same trace; a poison order is dead-lettered and its
// dead-letter record still carries the trace headers.
func TestTraceFromRequestToConsumerCommit(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()

	schema := pgtest.Schema(t)
	pool, err := pgxpool.New(ctx, exampletest.WithSearchPath(t, pgtest.URL(t), schema))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := createTable(ctx, pool); err != nil {
		t.Fatal(err)
	}
	k := kafkatest.New(t)
	k.RequireFake(t) // the topic "orders" is fixed: a shared broker would mix runs
	k.CreateTopic(t, "orders", 1, nil)
	k.CreateTopic(t, "orders.dlq", 1, nil)

	// The service.
	mux, err := newMux(pool, schema, slog.New(slog.DiscardHandler), tp)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mux)
	defer srv.Close()

	// The relay.
	pub, err := kgopublisher.New(k.Brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	reg := prometheus.NewRegistry()
	r, err := relay.New(pool, pub, &relay.Config{Schema: schema, PollInterval: 50 * time.Millisecond,
		Observer: otelonceflow.NewRelayObserver(relayprom.NewObserver(reg), otelonceflow.WithTracerProvider(tp))})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Add(1)
	go func() { defer wg.Done(); _ = r.Run(ctx) }()

	// The consumer: its handler starts a span of its own under the
	// consumer span, and refuses orders of 666 cents for good.
	tracer := tp.Tracer("shipping")
	p, err := consumer.New(pool, "shipping", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		ctx, span := tracer.Start(ctx, "ship order")
		defer span.End()
		if strings.Contains(string(m.Value), `"amount_cents":666`) {
			return consumer.Permanent(errors.New("cannot ship"))
		}
		_, err := tx.Exec(ctx, `SELECT 1`)
		return err
	}, &consumer.Config{Schema: schema, Hooks: []consumer.Hook{otelonceflow.NewConsumer(otelonceflow.WithTracerProvider(tp))}})
	if err != nil {
		t.Fatal(err)
	}
	c, err := kgoconsumer.New(p, &kgoconsumer.Config{Brokers: k.Brokers, Topics: []string{"orders"}, CommitInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	wg.Add(1)
	go func() { defer wg.Done(); _ = c.Run(ctx) }()

	post := func(key, body string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(body))
		req.Header.Set("X-User", "u1")
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("POST /orders: %d %s", resp.StatusCode, b)
		}
	}
	post("k1", `{"customer":"c1","amount_cents":500}`)

	consumerSpan := func(outcome string) sdktrace.ReadOnlySpan {
		for _, s := range rec.Ended() {
			if s.Name() == "process orders" && attr(s, "onceflow.outcome") == outcome {
				return s
			}
		}
		return nil
	}
	waitFor(t, 60*time.Second, "the consumer's span of the order", func() bool { return consumerSpan("processed") != nil })

	var server, ship, send sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		switch {
		case s.SpanKind() == trace.SpanKindServer:
			server = s
		case s.Name() == "ship order":
			ship = s
		case s.Name() == "send orders":
			send = s
		}
	}
	// The relay's span is a child of the request's, in its trace, with the
	// dwell time; the binary's histogram counted the event.
	if send == nil || send.Parent().SpanID() != server.SpanContext().SpanID() || send.SpanContext().TraceID() != server.SpanContext().TraceID() ||
		attr(send, "onceflow.outbox.dwell_seconds") == "" || send.SpanKind() != trace.SpanKindProducer {
		t.Errorf("relay span %v: want a producer span, child of the request's span, with onceflow.outbox.dwell_seconds", send)
	}
	if n := dwellCount(t, reg); n != 1 {
		t.Errorf("onceflow_outbox_dwell_seconds counted %d events, want 1", n)
	}
	processed := consumerSpan("processed")
	if server == nil || ship == nil {
		t.Fatalf("spans: server %v, handler %v; want both", server != nil, ship != nil)
	}
	if got := attr(server, "onceflow.idempotency.outcome"); got != "claimed" {
		t.Errorf("server span onceflow.idempotency.outcome = %q, want claimed", got)
	}
	if processed.SpanContext().TraceID() != server.SpanContext().TraceID() {
		t.Errorf("consumer span is in trace %s, the request in %s", processed.SpanContext().TraceID(), server.SpanContext().TraceID())
	}
	if processed.Parent().SpanID() != server.SpanContext().SpanID() {
		t.Errorf("consumer span's parent = %s, want the request's span %s", processed.Parent().SpanID(), server.SpanContext().SpanID())
	}
	if ship.Parent().SpanID() != processed.SpanContext().SpanID() {
		t.Errorf("handler span's parent = %s, want the consumer span %s", ship.Parent().SpanID(), processed.SpanContext().SpanID())
	}
	if processed.SpanKind() != trace.SpanKindConsumer {
		t.Errorf("consumer span kind = %v", processed.SpanKind())
	}
	for k, want := range map[string]string{
		"messaging.system":              "kafka",
		"messaging.operation.type":      "process",
		"messaging.destination.name":    "orders",
		"messaging.kafka.offset":        "0",
		"messaging.consumer.group.name": "shipping",
		"onceflow.consumer":             "shipping",
		"onceflow.duplicate":            "false",
		"onceflow.attempts":             "1",
	} {
		if got := attr(processed, k); got != want {
			t.Errorf("consumer span %s = %q, want %q", k, got, want)
		}
	}
	if attr(processed, "messaging.kafka.message.key") == "" || attr(processed, "messaging.message.id") == "" {
		t.Errorf("consumer span lacks the message key or id: %v", processed.Attributes())
	}

	// The same record delivered again: a duplicate, in the same trace.
	first := k.ReadAll(t, "orders", 1, 30*time.Second)
	if len(first) != 1 {
		t.Fatalf("read %d records from orders, want 1", len(first))
	}
	again := &kgo.Record{Topic: "orders", Key: first[0].Key, Value: first[0].Value, Headers: first[0].Headers}
	if err := k.Client(t).ProduceSync(ctx, again).FirstErr(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 60*time.Second, "the duplicate's span", func() bool { return consumerSpan("duplicate") != nil })
	dup := consumerSpan("duplicate")
	if attr(dup, "onceflow.duplicate") != "true" || dup.SpanContext().TraceID() != server.SpanContext().TraceID() {
		t.Errorf("duplicate span: duplicate=%s, trace %s; want true in the request's trace", attr(dup, "onceflow.duplicate"), dup.SpanContext().TraceID())
	}

	// A poison order is dead-lettered; its dead-letter record keeps the
	// trace headers the relay published.
	post("k2", `{"customer":"c1","amount_cents":666}`)
	waitFor(t, 60*time.Second, "the dead letter's span", func() bool { return consumerSpan("dead-lettered") != nil })
	dead := consumerSpan("dead-lettered")
	if dead.Status().Code.String() != "Error" || attr(dead, "onceflow.dead_letter.topic") != "orders.dlq" {
		t.Errorf("dead-letter span: status %v, topic %q", dead.Status(), attr(dead, "onceflow.dead_letter.topic"))
	}
	published := k.ReadAll(t, "orders", 3, 30*time.Second)
	dlq := k.ReadAll(t, "orders.dlq", 1, 30*time.Second)
	if len(published) != 3 || len(dlq) != 1 {
		t.Fatalf("read %d records from orders and %d from orders.dlq, want 3 and 1", len(published), len(dlq))
	}
	tp0 := header(published[2], "traceparent")
	if tp0 == "" || header(dlq[0], "traceparent") != tp0 {
		t.Errorf("dead-letter traceparent = %q, the published record's %q", header(dlq[0], "traceparent"), tp0)
	}
	if !strings.Contains(tp0, dead.SpanContext().TraceID().String()) {
		t.Errorf("published traceparent %q is not the dead-lettered span's trace %s", tp0, dead.SpanContext().TraceID())
	}
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

func attr(s sdktrace.ReadOnlySpan, key string) string {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value.String()
		}
	}
	return ""
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
