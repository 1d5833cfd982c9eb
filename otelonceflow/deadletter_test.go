package otelonceflow_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/otelonceflow"
)

// poisonError is a handler's error type, which error.type names.
type poisonError struct{}

func (poisonError) Error() string { return "poison" }

// The messaging conventions make error.type required "if and only if the
// messaging operation has failed": a dead-lettered message's span had
// status Error and no error.type. It names the handler's error type
// (consumer.Permanent is a marker, not the type), or onceflow's own
// identifier for a message without a usable id; a processed message's
// span has none.
func TestDeadLetteredSpanHasErrorType(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		headers []consumer.Header
		err     error
		want    string
	}{
		{name: "permanent", headers: []consumer.Header{{Key: "message-id", Value: []byte("dead-1")}},
			err: consumer.Permanent(poisonError{}), want: "github.com/onceflow/onceflow/otelonceflow_test.poisonError"},
		{name: "no id", err: nil, want: "onceflow.no_message_id"},
		{name: "processed", headers: []consumer.Header{{Key: "message-id", Value: []byte("ok-1")}}, want: ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rec := tracetest.NewSpanRecorder()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
			defer func() { _ = tp.Shutdown(context.Background()) }()
			p, err := consumer.New(pgtest.Pool(t), "shipping", func(context.Context, pgx.Tx, consumer.Message) error {
				return tc.err
			}, &consumer.Config{Schema: pgtest.Schema(t), Hooks: []consumer.Hook{otelonceflow.NewConsumer(otelonceflow.WithTracerProvider(tp))}})
			if err != nil {
				t.Fatal(err)
			}
			processOne(t, p, tc.headers)
			s := rec.Ended()[0]
			if got := attrOf(s, "error.type"); got != tc.want {
				t.Errorf("span (outcome %s, status %v) has error.type %q; want %q", attrOf(s, "onceflow.outcome"), s.Status(), got, tc.want)
			}
			if (tc.want != "") != (s.Status().Code == codes.Error) {
				t.Errorf("span status %v with error.type %q", s.Status(), tc.want)
			}
		})
	}
}
