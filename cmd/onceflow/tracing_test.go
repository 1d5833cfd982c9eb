package main

import (
	"context"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
)

// With OTEL_EXPORTER_OTLP_ENDPOINT set, the relay exports a span per
// published event that carries a trace context, over OTLP/HTTP.
func TestRelayExportsTracesOverOTLPWhenConfigured(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary; skipped with -short")
	}
	t.Parallel()
	var exports atomic.Int64
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.URL.Path == "/v1/traces" && len(b) > 0 {
			exports.Add(1)
		}
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK)
	}))
	defer collector.Close()

	bin := buildBinary(t)
	schema := pgtest.Schema(t)
	k := kafkatest.New(t)
	topic := k.Topic(t, 1)
	env := append(relayEnv(t, schema, k), "OTEL_EXPORTER_OTLP_ENDPOINT="+collector.URL, "OTEL_BSP_SCHEDULE_DELAY=100")
	p := startRelayProc(t, bin, env, "--log-level", "info")
	waitUntil(t, "the relay to start", 30*time.Second, relayStarted(p))

	w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
	ctx := context.Background()
	msg := outbox.Message{Topic: topic, Value: []byte("v"),
		Headers: map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}
	if err := pgx.BeginFunc(ctx, pgtest.Pool(t), func(tx pgx.Tx) error { return w.Write(ctx, tx, msg) }); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "an OTLP trace export", 60*time.Second, func() bool { return exports.Load() > 0 })
	_ = p.Signal(syscall.SIGTERM)
	if err, exited := p.Wait(30 * time.Second); !exited || err != nil {
		t.Fatalf("after SIGTERM: exited %v, err %v", exited, err)
	}
}

// OTEL_* settings the relay cannot honour (a platform injects them into
// every pod: the gRPC protocol, a console exporter) are a warning, not a
// reason to stop: the relay exited 1 before it started, and crash-looped
// over tracing it was not asked to do.
func TestRelayStartsDespiteOTELSettingsItCannotHonour(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary; skipped with -short")
	}
	t.Parallel()
	bin := buildBinary(t)
	schema := pgtest.Schema(t)
	k := kafkatest.New(t)
	env := append(relayEnv(t, schema, k), "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL=grpc", "OTEL_TRACES_EXPORTER=otlp,console")
	p := startRelayProc(t, bin, env, "--log-level", "info")
	waitUntil(t, "the relay to start", 30*time.Second, relayStarted(p))
	out := p.Output()
	for _, want := range []string{`OTEL_TRACES_EXPORTER: \"console\" is not supported`, `OTEL_EXPORTER_OTLP_PROTOCOL=\"grpc\" is not supported`} {
		if !strings.Contains(out, want) {
			t.Errorf("the relay's log does not say %s:\n%s", want, out)
		}
	}
	_ = p.Signal(syscall.SIGTERM)
	if err, exited := p.Wait(30 * time.Second); !exited || err != nil {
		t.Fatalf("after SIGTERM: exited %v, err %v", exited, err)
	}
}

// The relay's span of an event honours the producer's sampling decision,
// end to end: of 10 events of an unsampled producer trace (traceparent
// flags 00) and 10 of a sampled one (01), the binary exports exactly the
// 10 spans of the sampled trace, each a child of the producer's span in
// its trace. It exported all 20, the unsampled trace's in new traces of
// their own. The schedule delay outlasts the run, so the spans reach the
// collector only through the flush at SIGTERM.
func TestRelayExportsSpansOfSampledProducerTracesOnly(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary; skipped with -short")
	}
	t.Parallel()
	type span struct{ trace, parent string }
	var mu sync.Mutex
	var got []span
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var req coltrace.ExportTraceServiceRequest
		if err := proto.Unmarshal(b, &req); err == nil {
			mu.Lock()
			for _, rs := range req.ResourceSpans {
				for _, ss := range rs.ScopeSpans {
					for _, s := range ss.Spans {
						got = append(got, span{hex.EncodeToString(s.TraceId), hex.EncodeToString(s.ParentSpanId)})
					}
				}
			}
			mu.Unlock()
		}
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK)
	}))
	defer collector.Close()

	bin := buildBinary(t)
	schema := pgtest.Schema(t)
	k := kafkatest.New(t)
	topic := k.Topic(t, 1)
	env := append(relayEnv(t, schema, k), "OTEL_EXPORTER_OTLP_ENDPOINT="+collector.URL, "OTEL_BSP_SCHEDULE_DELAY=600000")
	p := startRelayProc(t, bin, env, "--log-level", "info")
	waitUntil(t, "the relay to start", 30*time.Second, relayStarted(p))

	const unsampled, sampled, producerSpan = "0af7651916cd43dd8448eb211c80319c", "1bf7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
	w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
	ctx := context.Background()
	var msgs []outbox.Message
	for i := range 20 {
		tp := "00-" + unsampled + "-" + producerSpan + "-00"
		if i%2 == 1 {
			tp = "00-" + sampled + "-" + producerSpan + "-01"
		}
		msgs = append(msgs, outbox.Message{Topic: topic, Value: []byte("v"), Headers: map[string]string{"traceparent": tp}})
	}
	if err := pgx.BeginFunc(ctx, pgtest.Pool(t), func(tx pgx.Tx) error { return w.Write(ctx, tx, msgs...) }); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the outbox to drain", 30*time.Second, func() bool { return count(t, schema, "outbox") == 0 })
	_ = p.Signal(syscall.SIGTERM)
	if err, exited := p.Wait(30 * time.Second); !exited || err != nil {
		t.Fatalf("after SIGTERM: exited %v, err %v", exited, err)
	}
	mu.Lock()
	defer mu.Unlock()
	bad := 0
	for _, s := range got {
		if s.trace != sampled || s.parent != producerSpan {
			bad++
		}
	}
	if len(got) != 10 || bad > 0 {
		t.Errorf("the relay exported %d spans, %d of them not children of the sampled producer span; want the 10 of the sampled trace, children of its span", len(got), bad)
	}
}
