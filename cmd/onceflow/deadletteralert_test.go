package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/consumerprom"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// promtoolPath finds Prometheus's promtool as the deploy package's tests
// do: $PROMTOOL, else on PATH.
func promtoolPath(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("PROMTOOL"); p != "" {
		return p
	}
	p, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool not found: install it (apt-get install prometheus, or a Prometheus release) or set PROMTOOL")
	}
	return p
}

// dlqTransport takes every dead letter.
type dlqTransport struct{ done chan struct{} }

func (d dlqTransport) MarkDone(consumer.Message) { d.done <- struct{}{} }

func (dlqTransport) PublishDeadLetter(context.Context, consumer.DeadLetter) error { return nil }

// The first message of a topic a consumer takes since it started is
// dead-lettered at once (here: it has no message id). Its dead-letter
// counter is then first scraped at 1, never seen at 0, and increase() of
// a series born at 1 that stays there is 0: before the fix
// OnceflowConsumerDeadLetters never fired for it. The series a scrape
// every minute would have collected from the real consumer go through the
// shipped rules with promtool.
func TestFirstDeadLetterOfATopicFiresItsAlert(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewPedanticRegistry()
	p, err := consumer.New(pgtest.Pool(t), "ledger", func(context.Context, pgx.Tx, consumer.Message) error {
		return nil
	}, &consumer.Config{Schema: pgtest.Schema(t), Hooks: []consumer.Hook{consumerprom.NewHook(reg)}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tr := dlqTransport{done: make(chan struct{}, 1)}
	part := p.StartPartition(ctx, tr)
	defer part.Stop(ctx)
	const series = `onceflow_consumer_dead_letters_total{consumer="ledger",topic="payments"}`
	scrape := func() string {
		t.Helper()
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
		for _, l := range strings.Split(b.String(), "\n") {
			if v, ok := strings.CutPrefix(l, series+" "); ok {
				return v
			}
		}
		return "_" // no such series
	}
	before := scrape()
	// A producer in another language left the message-id header out.
	if err := part.Add(ctx, consumer.Message{Topic: "payments", Value: []byte("x"), Timestamp: time.Now()}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-tr.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the consumer did not finish the message")
	}
	after := scrape()
	if after != "1" {
		t.Fatalf("%s after the dead letter: %s, want 1", series, after)
	}
	// Scraped every minute: the value before, then the dead letter's for
	// good.
	values := before + " 1x40"
	rules, err := filepath.Abs("../../deploy/prometheus/onceflow-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	test := `rule_files: [` + rules + `]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'onceflow_consumer_dead_letters_total{job="w",instance="a",consumer="ledger",topic="payments"}'
        values: '` + values + `'
    promql_expr_test:
      - expr: ALERTS{alertname="OnceflowConsumerDeadLetters"}
        eval_time: 5m
        exp_samples:
          - labels: 'ALERTS{alertname="OnceflowConsumerDeadLetters",alertstate="firing",severity="warning",job="w",consumer="ledger",topic="payments"}'
            value: 1
      - expr: ALERTS{alertname="OnceflowConsumerDeadLetters"}
        eval_time: 30m
        exp_samples: []
`
	f := filepath.Join(t.TempDir(), "first-dead-letter.test.yml")
	if err := os.WriteFile(f, []byte(test), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtoolPath(t), "test", "rules", f).CombinedOutput(); err != nil {
		t.Fatalf("one message dead-lettered (series scraped as %q): OnceflowConsumerDeadLetters must fire within 15 minutes and clear after:\n%s", values, out)
	}
}
