package consumerprom_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/consumerprom"
	"github.com/onceflow/onceflow/internal/pgtest"
)

type transport struct{ last chan int64 }

func (t transport) MarkDone(m consumer.Message) { t.last <- m.Offset }

func (transport) PublishDeadLetter(context.Context, consumer.DeadLetter) error { return nil }

func TestHookCountsOutcomes(t *testing.T) {
	schema := pgtest.Schema(t)
	reg := prometheus.NewPedanticRegistry()
	hook := consumerprom.NewHook(reg)
	p, err := consumer.New(pgtest.Pool(t), "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if string(m.Value) == "bad" {
			return errors.New("bad")
		}
		return nil
	}, &consumer.Config{Schema: schema, MaxAttempts: 2, MinBackoff: time.Millisecond, Hooks: []consumer.Hook{hook}})
	if err != nil {
		t.Fatal(err)
	}
	tr := transport{last: make(chan int64, 10)}
	ctx := context.Background()
	w := p.StartPartition(ctx, tr)
	defer w.Stop(ctx)
	id := func(s string) []consumer.Header { return []consumer.Header{{Key: "message-id", Value: []byte(s)}} }
	ts := time.Now().Add(-time.Hour)
	_ = w.Add(ctx,
		consumer.Message{Topic: "t", Offset: 0, Headers: id("a"), Timestamp: ts},
		consumer.Message{Topic: "t", Offset: 1, Headers: id("a"), Timestamp: ts},
		consumer.Message{Topic: "t", Offset: 2, Headers: id("b"), Value: []byte("bad"), Timestamp: ts},
	)
	for want := int64(0); want < 3; {
		select {
		case got := <-tr.last:
			want = got + 1
		case <-time.After(20 * time.Second):
			t.Fatal("messages not finished")
		}
	}
	want := `
# HELP onceflow_consumer_messages_total Messages finished, by outcome: processed (handler committed), duplicate (skipped), dead-lettered.
# TYPE onceflow_consumer_messages_total counter
onceflow_consumer_messages_total{consumer="ledger",outcome="dead-lettered",topic="t"} 1
onceflow_consumer_messages_total{consumer="ledger",outcome="duplicate",topic="t"} 1
onceflow_consumer_messages_total{consumer="ledger",outcome="processed",topic="t"} 1
# HELP onceflow_consumer_retries_total Failed attempts that will be retried: handler errors, connections lost in a transaction, and waits for an unreachable database.
# TYPE onceflow_consumer_retries_total counter
onceflow_consumer_retries_total{consumer="ledger",topic="t"} 1
# HELP onceflow_consumer_dead_letters_total Messages published to their dead-letter topic, by the topic they came from.
# TYPE onceflow_consumer_dead_letters_total counter
onceflow_consumer_dead_letters_total{consumer="ledger",topic="t"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"onceflow_consumer_messages_total", "onceflow_consumer_retries_total", "onceflow_consumer_dead_letters_total"); err != nil {
		t.Fatal(err)
	}
	// The dead-letter failure counters exist at 0 from the topic's first
	// message: born at 1 on the first failure, that failure was no
	// increase() to the missing-topic alert.
	checkDeadLetterFailures(t, reg, 0, 0, 0)
	if n := testutil.CollectAndCount(reg, "onceflow_consumer_transaction_seconds"); n != 1 {
		t.Fatalf("transaction histograms = %d, want 1", n)
	}
	// The lag is the age of the record finished last: an hour, give or take
	// the test's own run time.
	var lag float64
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "onceflow_consumer_lag_seconds" && len(mf.GetMetric()) == 1 {
			lag = mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	if lag < 3600 || lag > 3600+60 {
		t.Fatalf("onceflow_consumer_lag_seconds = %v, want about 3600", lag)
	}
	problems, err := testutil.GatherAndLint(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("promlint: %s: %s", p.Metric, p.Text)
	}
}

// missingDLQ fails its first dead-letter publish as a missing topic, its
// second as something else, its third as too large (and the dead letter,
// of a message with no key, value or headers but its id, cannot be made
// smaller: only an operator moves its partition on).
type missingDLQ struct {
	transport
	calls int
}

func (m *missingDLQ) PublishDeadLetter(context.Context, consumer.DeadLetter) error {
	m.calls++
	switch m.calls {
	case 1:
		return fmt.Errorf("publish: %w", consumer.ErrDeadLetterTopicMissing)
	case 2:
		return errors.New("broker unavailable")
	case 3:
		return fmt.Errorf("publish: %w", consumer.ErrDeadLetterTooLarge)
	}
	return nil
}

func TestHookCountsDeadLetterFailures(t *testing.T) {
	schema := pgtest.Schema(t)
	reg := prometheus.NewPedanticRegistry()
	hook := consumerprom.NewHook(reg)
	p, err := consumer.New(pgtest.Pool(t), "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return consumer.Permanent(errors.New("bad"))
	}, &consumer.Config{Schema: schema, MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond, Hooks: []consumer.Hook{hook}})
	if err != nil {
		t.Fatal(err)
	}
	tr := &missingDLQ{transport: transport{last: make(chan int64, 1)}}
	ctx := context.Background()
	w := p.StartPartition(ctx, tr)
	defer w.Stop(ctx)
	_ = w.Add(ctx, consumer.Message{Topic: "t", Headers: []consumer.Header{{Key: "message-id", Value: []byte("a")}}})
	select {
	case <-tr.last:
	case <-time.After(20 * time.Second):
		t.Fatal("message not finished")
	}
	checkDeadLetterFailures(t, reg, 1, 1, 1)
}

// TestABatchTransactionIsTimedOnce: in batch mode a transaction's time is
// the batch's (OnBatch, mode="batch"). A batch of one message (the usual
// batch at low traffic: a batch never waits to fill) was timed a second
// time as a per-message transaction, because OnDone took BatchSize 1 for
// per-message mode.
func TestABatchTransactionIsTimedOnce(t *testing.T) {
	schema := pgtest.Schema(t)
	reg := prometheus.NewPedanticRegistry()
	p, err := consumer.NewBatch(pgtest.Pool(t), "ledger", func(ctx context.Context, tx pgx.Tx, ms []consumer.Message) error {
		return nil
	}, &consumer.Config{Schema: schema, Hooks: []consumer.Hook{consumerprom.NewHook(reg)}})
	if err != nil {
		t.Fatal(err)
	}
	tr := transport{last: make(chan int64, 10)}
	ctx := context.Background()
	w := p.StartPartition(ctx, tr)
	defer w.Stop(ctx)
	_ = w.Add(ctx, consumer.Message{Topic: "t", Offset: 0, Headers: []consumer.Header{{Key: "message-id", Value: []byte("a")}}})
	// Then the same message again: a batch of duplicates only, rolled
	// back, is no committed transaction.
	for offset := range int64(2) {
		if offset == 1 {
			_ = w.Add(ctx, consumer.Message{Topic: "t", Offset: 1, Headers: []consumer.Header{{Key: "message-id", Value: []byte("a")}}})
		}
		select {
		case <-tr.last:
		case <-time.After(20 * time.Second):
			t.Fatalf("message %d not finished", offset)
		}
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	timed := map[string]uint64{}
	for _, f := range families {
		if f.GetName() != "onceflow_consumer_transaction_seconds" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "mode" {
					timed[l.GetValue()] += m.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	if timed["batch"] != 1 || timed["message"] != 0 {
		t.Fatalf("transactions timed by mode: %v, want one batch (the duplicates' rolled back) and no per-message transaction", timed)
	}
}

// checkDeadLetterFailures compares consumer "ledger"'s dead-letter failure
// counters of topic "t" by reason.
func checkDeadLetterFailures(t *testing.T, reg prometheus.Gatherer, other, topicMissing, tooLarge int) {
	t.Helper()
	want := fmt.Sprintf(`
# HELP onceflow_consumer_dead_letter_failures_total Failed publishes of dead letters (retried; the message's partition waits), by the topic they came from. reason=topic-missing lasts until the dead-letter topic is created; reason=too-large until its max.message.bytes is raised.
# TYPE onceflow_consumer_dead_letter_failures_total counter
onceflow_consumer_dead_letter_failures_total{consumer="ledger",reason="other",topic="t"} %d
onceflow_consumer_dead_letter_failures_total{consumer="ledger",reason="too-large",topic="t"} %d
onceflow_consumer_dead_letter_failures_total{consumer="ledger",reason="topic-missing",topic="t"} %d
`, other, tooLarge, topicMissing)
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "onceflow_consumer_dead_letter_failures_total"); err != nil {
		t.Fatal(err)
	}
}
