package main

import (
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/onceflow/onceflow/otelonceflow"
	"github.com/onceflow/onceflow/relay"
)

// withTracing adds a producer span per published event carrying a trace
// context (a child of it, sampled as it was, with its outbox dwell time)
// when tp exports; with
// the OTEL_* variables unset tp is a no-op and obs is returned as is.
func withTracing(obs relay.Observer, tp trace.TracerProvider) relay.Observer {
	if _, off := tp.(noop.TracerProvider); off {
		return obs
	}
	return otelonceflow.NewRelayObserver(obs, otelonceflow.WithTracerProvider(tp))
}
