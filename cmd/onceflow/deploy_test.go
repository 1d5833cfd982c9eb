package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/consumerprom"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
)

// metricNames returns the onceflow metric names a file names, histogram
// series (_bucket, _sum, _count) included as written.
func metricNames(t *testing.T, file string) []string {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	names := regexp.MustCompile(`\bonceflow_[a-z0-9_]*[a-z0-9]`).FindAllString(string(b), -1)
	slices.Sort(names)
	return slices.Compact(names)
}

// exposedNames returns the series names in a text exposition.
func exposedNames(t *testing.T, text string) map[string]bool {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	out := map[string]bool{}
	for name, mf := range mfs {
		out[name] = true
		if mf.GetType().String() == "HISTOGRAM" {
			out[name+"_bucket"], out[name+"_sum"], out[name+"_count"] = true, true, true
		}
	}
	return out
}

// Every metric the Grafana dashboard and the alert rules name exists: in a
// running relay's /metrics (with an event pending, so the per-shard series
// are there) or in an idempotent consumer's consumerprom metrics. The
// relay's metrics pass promlint (what `promtool check metrics` runs).
func TestDashboardAndAlertMetricsExist(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary; skipped with -short")
	}
	t.Parallel()
	bin := buildBinary(t)
	schema := pgtest.Schema(t)
	k := kafkatest.New(t)
	topic := k.Topic(t, 1)
	addr := freeAddr(t)
	p := startRelayProc(t, bin, relayEnv(t, schema, k), "--http-addr", addr, "--log-level", "info", "--unknown-topic-grace", "10m")
	waitUntil(t, "the relay to start", 30*time.Second, relayStarted(p))

	// One event is published; one waits on a topic that does not exist
	// (retried through the grace period), so backlog series are exposed.
	w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, pgtest.Pool(t), func(tx pgx.Tx) error {
		return w.Write(ctx, tx,
			outbox.Message{Topic: topic, Key: []byte("k"), Value: []byte("v")},
			outbox.Message{Topic: topic + "-missing", Key: []byte("k"), Value: []byte("v")})
	}); err != nil {
		t.Fatal(err)
	}
	var relayMetrics string
	waitUntil(t, "the relay to publish one event and retry the other", 30*time.Second, func() bool {
		_, relayMetrics = httpGet("http://" + addr + "/metrics")
		return strings.Contains(relayMetrics, "onceflow_relay_published_total 1") &&
			strings.Contains(relayMetrics, "onceflow_outbox_backlog_events 1") &&
			!strings.Contains(relayMetrics, "onceflow_outbox_max_attempts 0")
	})
	problems, err := promlint.New(strings.NewReader(relayMetrics)).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		if strings.HasPrefix(p.Metric, "onceflow_") {
			t.Errorf("promlint: %s: %s", p.Metric, p.Text)
		}
	}
	exposed := exposedNames(t, relayMetrics)
	for name := range exposedNames(t, consumerMetrics(t)) {
		exposed[name] = true
	}

	var checked int
	for _, file := range []string{"../../deploy/grafana/onceflow.json", "../../deploy/prometheus/onceflow-rules.yml"} {
		for _, name := range metricNames(t, file) {
			checked++
			if !exposed[name] {
				t.Errorf("%s names %s, which neither the relay nor consumerprom exposes", file, name)
			}
		}
	}
	if checked < 15 {
		t.Fatalf("only %d metric names found in the dashboard and rules", checked)
	}
	_ = p.Signal(syscall.SIGTERM)
	if err, exited := p.Wait(30 * time.Second); !exited || err != nil {
		t.Fatalf("after SIGTERM: exited %v, err %v", exited, err)
	}
}

type fakeTransport struct {
	done chan struct{}
	// deadLetters counts PublishDeadLetter calls; the first fails with a
	// missing dead-letter topic (so its failure counter is exposed too).
	deadLetters *atomic.Int32
}

func (f fakeTransport) MarkDone(consumer.Message) { f.done <- struct{}{} }

func (f fakeTransport) PublishDeadLetter(context.Context, consumer.DeadLetter) error {
	if f.deadLetters.Add(1) == 1 {
		return fmt.Errorf("payments.dlq: %w", consumer.ErrDeadLetterTopicMissing)
	}
	return nil
}

// consumerMetrics runs a consumer with consumerprom through a processed,
// a duplicate and a dead-lettered (after one retry, and one failed publish
// to a missing dead-letter topic) message, and returns its metrics as text.
func consumerMetrics(t *testing.T) string {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	p, err := consumer.New(pgtest.Pool(t), "metrics-test", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if string(m.Value) == "bad" {
			return errors.New("bad")
		}
		return nil
	}, &consumer.Config{Schema: pgtest.Schema(t), MaxAttempts: 2, MinBackoff: time.Millisecond,
		Hooks: []consumer.Hook{consumerprom.NewHook(reg)}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tr := fakeTransport{done: make(chan struct{}, 3), deadLetters: new(atomic.Int32)}
	part := p.StartPartition(ctx, tr)
	defer part.Stop(ctx)
	id := func(s string) []consumer.Header {
		return []consumer.Header{{Key: consumer.MessageIDHeader, Value: []byte(s)}}
	}
	now := time.Now()
	_ = part.Add(ctx,
		consumer.Message{Topic: "payments", Offset: 0, Headers: id("a"), Timestamp: now},
		consumer.Message{Topic: "payments", Offset: 1, Headers: id("a"), Timestamp: now},
		consumer.Message{Topic: "payments", Offset: 2, Headers: id("b"), Value: []byte("bad"), Timestamp: now})
	for range 3 {
		select {
		case <-tr.done:
		case <-time.After(30 * time.Second):
			t.Fatal("consumer did not finish its three messages")
		}
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	for _, mf := range mfs {
		if _, err := expfmt.MetricFamilyToText(&b, mf); err != nil {
			t.Fatal(err)
		}
	}
	return b.String()
}
