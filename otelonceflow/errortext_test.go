package otelonceflow_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/otelonceflow"
)

// A handler's error may carry a whole payload. Its whole text went on
// every retry event, the recorded error and the status: a 1 MiB error
// over a few attempts made a span of several MiB, enough to get an OTLP
// export batch rejected. The text on the span is cut, to valid UTF-8.
func TestConsumerSpanCapsTheErrorText(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		text string
	}{
		{name: "ascii", text: strings.Repeat("x", 1<<20)},
		// Two-byte runes after one byte: any cut at an even length
		// splits a rune.
		{name: "multi-byte", text: "x" + strings.Repeat("é", 1<<19)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rec := tracetest.NewSpanRecorder()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
			defer func() { _ = tp.Shutdown(context.Background()) }()
			const attempts = 3
			p, err := consumer.New(pgtest.Pool(t), "shipping", func(context.Context, pgx.Tx, consumer.Message) error {
				return errors.New(tc.text)
			}, &consumer.Config{Schema: pgtest.Schema(t), MaxAttempts: attempts, MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond,
				Logger: slog.New(slog.DiscardHandler), // megabytes of error text otherwise
				Hooks:  []consumer.Hook{otelonceflow.NewConsumer(otelonceflow.WithTracerProvider(tp))}})
			if err != nil {
				t.Fatal(err)
			}
			processOne(t, p, idHeader("big-error"))
			spans := rec.Ended()
			if len(spans) != 1 {
				t.Fatalf("%d spans, want 1", len(spans))
			}
			s := spans[0]
			if attrOf(s, "onceflow.outcome") != "dead-lettered" || attrOf(s, "onceflow.attempts") != "3" {
				t.Fatalf("span outcome %q after %s attempts; want dead-lettered after %d", attrOf(s, "onceflow.outcome"), attrOf(s, "onceflow.attempts"), attempts)
			}
			texts := []string{s.Status().Description}
			for _, kv := range s.Attributes() {
				texts = append(texts, kv.Value.String())
			}
			var retries, recorded int
			for _, e := range s.Events() {
				switch e.Name {
				case "retry":
					retries++
				case "exception":
					recorded++
					for _, kv := range e.Attributes {
						// What span.RecordError records for errors.New's error.
						if kv.Key == "exception.type" && kv.Value.AsString() != "*errors.errorString" {
							t.Errorf("exception.type = %q, want *errors.errorString", kv.Value.AsString())
						}
					}
				}
				for _, kv := range e.Attributes {
					texts = append(texts, kv.Value.String())
				}
			}
			if retries != attempts-1 || recorded != 1 {
				t.Errorf("span has %d retry and %d exception events; want %d and 1", retries, recorded, attempts-1)
			}
			total := 0
			for _, text := range texts {
				total += len(text)
				if !utf8.ValidString(text) {
					t.Errorf("span text %.40q... is not valid UTF-8", text)
				}
			}
			if total > 64<<10 {
				t.Errorf("span carries %d bytes of text for a %d-byte error over %d attempts; want at most 64 KiB", total, len(tc.text), attempts)
			}
			if d := s.Status().Description; !strings.HasPrefix(d, "dead-lettered: x") {
				t.Errorf("status description %.40q...; want the error's text, cut", d)
			}
		})
	}
}
