package otelenv

import (
	"context"
	"net"
	"strings"
	"sync"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace/noop"
)

// A value this package does not support is a warning and is ignored, as
// the OpenTelemetry specification asks of an unrecognised enum value: a
// platform that injects OTEL_* variables into every pod (an exporter list
// with console, the gRPC protocol) made the relay exit before it started.
func TestEnabledFollowsTheStandardVariables(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env      map[string]string
		want     bool
		wantWarn string
	}{
		{env: nil, want: false},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, want: true},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, want: true},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, want: true},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, want: false},
		{env: map[string]string{"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, want: false},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, want: false, wantWarn: `OTEL_TRACES_EXPORTER: "zipkin" is not supported`},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp, console"}, want: true, wantWarn: `OTEL_TRACES_EXPORTER: "console" is not supported`},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, want: false,
			wantWarn: `OTEL_EXPORTER_OTLP_PROTOCOL="grpc" is not supported`},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, want: true},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, want: false},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp,"}, want: true},
	} {
		var warnings []string
		got := Enabled(func(k string) string { return tc.env[k] }, func(w string) { warnings = append(warnings, w) })
		warned := strings.Join(warnings, "\n")
		if got != tc.want || (tc.wantWarn == "") != (warned == "") || !strings.Contains(warned, tc.wantWarn) {
			t.Errorf("Enabled(%v) = %v, warned %q; want %v, a warning with %q", tc.env, got, warned, tc.want, tc.wantWarn)
		}
	}
}

// Setup with a protocol it cannot speak runs without tracing and says so,
// rather than failing the program that asked for it.
func TestSetupWithAnUnsupportedProtocolDoesNotFail(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	var warnings []string
	tp, shutdown, err := Setup(context.Background(), "test", func(w string) { warnings = append(warnings, w) })
	if err != nil {
		t.Fatalf("Setup: %v", err)
	}
	defer shutdown()
	if _, off := tp.(noop.TracerProvider); !off || len(warnings) != 1 {
		t.Fatalf("provider %T, warnings %q: want no tracing and one warning", tp, warnings)
	}
}

// The specification asks enum values to be read case-insensitively, as
// OTEL_SDK_DISABLED already was: OTEL_TRACES_EXPORTER=OTLP turned export
// off with a warning that otlp "is not supported", and NONE warned
// instead of turning it off.
func TestEnabledReadsEnumValuesCaseInsensitively(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env  map[string]string
		want bool
	}{
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "OTLP"}, want: true},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "Otlp, Console"}, want: true},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "HTTP/PROTOBUF"}, want: true},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "Http/Protobuf"}, want: true},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "NONE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, want: false},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": " http/protobuf "}, want: true},
	} {
		var warnings []string
		got := Enabled(func(k string) string { return tc.env[k] }, func(w string) { warnings = append(warnings, w) })
		wantWarn := tc.env["OTEL_TRACES_EXPORTER"] == "Otlp, Console"
		if got != tc.want || (len(warnings) > 0) != wantWarn {
			t.Errorf("Enabled(%v) = %v, warned %q; want %v, warned %v", tc.env, got, warnings, tc.want, wantWarn)
		}
	}
}

// Spans the shutdown could not flush (a collector that does not answer
// within the 5 s the flush gets) are lost: the shutdown says so through
// warn instead of dropping the error.
func TestShutdownWarnsOfSpansItCouldNotFlush(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var mu sync.Mutex
	var conns []net.Conn
	go func() { // accepts, reads nothing, never answers
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	}()
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+ln.Addr().String())
	var mu2 sync.Mutex
	var warnings []string
	tp, shutdown, err := Setup(context.Background(), "test", func(w string) {
		mu2.Lock()
		defer mu2.Unlock()
		warnings = append(warnings, w)
	})
	if err != nil {
		t.Fatalf("Setup: %v", err)
	}
	defer otel.SetTracerProvider(noop.NewTracerProvider())
	_, span := tp.Tracer("t").Start(context.Background(), "s")
	span.End()
	shutdown()
	mu2.Lock()
	defer mu2.Unlock()
	if len(warnings) != 1 || !strings.Contains(warnings[0], "shutdown") {
		t.Fatalf("warnings %q: want one saying the shutdown failed to flush", warnings)
	}
	t.Logf("warned: %s", warnings[0])
}
