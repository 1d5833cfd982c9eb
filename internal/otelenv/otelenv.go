// Package otelenv sets up trace export from the standard OTEL_* environment
// variables, for the onceflow binary and the examples. With none of them
// set it does nothing: the returned provider is a no-op and no connection
// is made.
package otelenv

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Enabled reports whether the environment asks for trace export:
// OTEL_TRACES_EXPORTER=otlp, or an OTLP endpoint
// (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) with
// OTEL_TRACES_EXPORTER unset. OTEL_SDK_DISABLED=true and
// OTEL_TRACES_EXPORTER=none turn it off. A value it does not support is
// passed to warn and ignored, as the OpenTelemetry specification asks of
// an unrecognised value (platforms inject these variables into every
// process; tracing must not stop one from starting): an exporter other
// than otlp in the list, and a protocol other than http/protobuf, which
// turns export off (HTTP sent to a gRPC collector's port cannot work).
// Values are read case-insensitively, as the specification asks of enum
// values: OTEL_TRACES_EXPORTER=OTLP is otlp, NONE is none.
func Enabled(getenv func(string) string, warn func(string)) bool {
	if strings.EqualFold(getenv("OTEL_SDK_DISABLED"), "true") {
		return false
	}
	on := getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
	if list := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER")); list != "" {
		on = false
		for _, exp := range strings.Split(list, ",") {
			switch exp = strings.TrimSpace(exp); strings.ToLower(exp) {
			case "":
			case "otlp":
				on = true
			case "none":
				return false
			default:
				warn(fmt.Sprintf("OTEL_TRACES_EXPORTER: %q is not supported (only otlp and none): ignored", exp))
			}
		}
	}
	if !on {
		return false
	}
	name, proto := "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if proto == "" {
		name, proto = "OTEL_EXPORTER_OTLP_PROTOCOL", getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	if p := strings.TrimSpace(proto); p != "" && !strings.EqualFold(p, "http/protobuf") {
		warn(fmt.Sprintf("%s=%q is not supported (only http/protobuf): traces are not exported", name, proto))
		return false
	}
	return true
}

// Setup returns the tracer provider the environment asks for and a
// function that flushes and stops it (waiting at most 5 s; a flush that
// does not finish in time, spans lost, goes to warn). When tracing is
// enabled it also becomes the global provider, with the W3C trace-context
// and baggage propagators. The exporter speaks OTLP over HTTP
// (http/protobuf) and reads the other OTEL_EXPORTER_OTLP_* variables itself
// (headers, timeout, TLS); OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
// name the service (service defaults to service). Settings it does not
// support go to warn (see Enabled).
func Setup(ctx context.Context, service string, warn func(string)) (trace.TracerProvider, func(), error) {
	if !Enabled(os.Getenv, warn) {
		return noop.NewTracerProvider(), func() {}, nil
	}
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("otlp trace exporter: %w", err)
	}
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(semconv.ServiceName(service)))
	if err != nil {
		return nil, nil, fmt.Errorf("trace resource: %w", err)
	}
	// The environment's service name and attributes win over the default.
	if env, err := resource.New(ctx, resource.WithFromEnv()); err == nil {
		if merged, err := resource.Merge(res, env); err == nil {
			res = merged
		}
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	return tp, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tp.Shutdown(ctx); err != nil {
			warn(fmt.Sprintf("shutdown: spans not yet exported may be lost: %v", err))
		}
	}, nil
}
