package otelonceflow_test

import (
	"context"
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

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/otelonceflow"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
	"github.com/onceflow/onceflow/relay/relayprom"
)

// The binary wraps relayprom's Observer in a RelayObserver whenever OTEL_*
// asks for traces (cmd/onceflow/tracing.go). Since onceflow_relay_sick_partitions
// is fed only by relay.SickPartitionObserver, the wrapper must pass those
// calls on, or the gauge stays 0 while a partition is sick.
func TestRelayObserverPassesOnSickPartitionCounts(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
	defer func() { _ = tp.Shutdown(context.Background()) }()

	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	k := kafkatest.New(t)
	fake := k.RequireFake(t)
	topic := k.Topic(t, 1)
	fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.NotEnoughReplicas, Count: -1})
	w, err := outbox.NewWriter(&outbox.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return w.Write(ctx, tx, outbox.Message{Topic: topic, Key: []byte("k"), Value: []byte("v")})
	}); err != nil {
		t.Fatal(err)
	}
	pub, err := kgopublisher.New(k.Brokers, &kgopublisher.Config{Opts: []kgo.Opt{
		kgo.MetadataMinAge(50 * time.Millisecond),
		kgo.RetryBackoffFn(func(int) time.Duration { return 20 * time.Millisecond }),
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	reg := prometheus.NewRegistry()
	obs := otelonceflow.NewRelayObserver(relayprom.NewObserver(reg), otelonceflow.WithTracerProvider(tp))
	if _, ok := relay.Observer(obs).(relay.SickPartitionObserver); !ok {
		t.Errorf("otelonceflow.RelayObserver does not implement relay.SickPartitionObserver: relay.New never reports sick counts through it")
	}
	r, err := relay.New(pool, pub, &relay.Config{Schema: schema, PollInterval: 50 * time.Millisecond, PublishTimeout: 500 * time.Millisecond, Observer: obs})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() { cancel(); <-done }()

	outboxTable := pgx.Identifier{schema, "outbox"}.Sanitize()
	waitUntil(t, 60*time.Second, "the event to fail twice (the partition is marked sick)", func() bool {
		var attempts int
		err := pool.QueryRow(ctx, `SELECT attempts FROM `+outboxTable).Scan(&attempts)
		return err == nil && attempts >= 2
	})
	if g := gaugeValue(t, reg, "onceflow_relay_sick_partitions"); g != 1 {
		t.Fatalf("onceflow_relay_sick_partitions = %g with the topic's only partition sick, want 1", g)
	}
}

func gaugeValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("%s not registered", name)
	return 0
}

// BatchStats.SickPartitionsReported tells an Observer that the relay also
// reports the changes of SickPartitions to it, so it must not count them
// from BatchStats too. A RelayObserver always receives those changes, but
// passes them on only to a next that is a relay.SickPartitionObserver: a
// plain next told they were reported counted no sick partitions at all.
func TestRelayObserverSaysSickPartitionsReportedOnlyWhenNextGetsThem(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		next     interface{ last() relay.BatchStats }
		reported bool
		want     bool
	}{
		{name: "plain next", next: &statsObserver{}, reported: true, want: false},
		{name: "sick partition observer", next: &sickStatsObserver{}, reported: true, want: true},
		{name: "not reported by the relay", next: &sickStatsObserver{}, reported: false, want: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			obs := otelonceflow.NewRelayObserver(tc.next.(relay.Observer))
			obs.ObserveBatch(relay.BatchStats{SickPartitions: 2, SickPartitionsReported: tc.reported})
			got := tc.next.last()
			if got.SickPartitionsReported != tc.want {
				t.Errorf("next got SickPartitionsReported = %t, want %t", got.SickPartitionsReported, tc.want)
			}
			if got.SickPartitions != 2 {
				t.Errorf("next got SickPartitions = %d, want 2", got.SickPartitions)
			}
		})
	}
}

// statsObserver is a relay.Observer, and no SickPartitionObserver, that
// keeps the last BatchStats.
type statsObserver struct{ stats relay.BatchStats }

func (o *statsObserver) ObserveBatch(s relay.BatchStats) { o.stats = s }
func (o *statsObserver) ObserveShards(int)               {}
func (o *statsObserver) last() relay.BatchStats          { return o.stats }

// sickStatsObserver is a statsObserver that is a SickPartitionObserver.
type sickStatsObserver struct{ statsObserver }

func (o *sickStatsObserver) SickPartitionsChanged(int) {}
