package consumerprom_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/consumerprom"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// gauge returns the value of a series of consumer "ledger", topic "t", and
// whether it is exposed.
func gauge(t *testing.T, reg prometheus.Gatherer, name string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["consumer"] == "ledger" && labels["topic"] == "t" {
				if m.GetCounter() != nil {
					return m.GetCounter().GetValue(), true
				}
				return m.GetGauge().GetValue(), true
			}
		}
	}
	return 0, false
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// A handler that hangs finishes nothing and retries nothing, and the lag
// gauge holds the last finished message's lag: the in-flight age is what
// shows it (OnceflowConsumerHung). It grows while the handler hangs, is 0
// once the message is finished, stays low through a failing message's
// backoffs however long they are, and is 0 again for a message abandoned
// (its partition stopped). The topic's counters exist at 0 from the moment
// its first message is taken, before any outcome.
func TestHookReportsTheOldestAttemptInFlight(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewPedanticRegistry()
	started := make(chan string, 10)
	release := make(chan struct{})
	p, err := consumer.New(pgtest.Pool(t), "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		started <- string(m.Value)
		switch string(m.Value) {
		case "hang":
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		case "fail":
			return errors.New("downstream unavailable")
		}
		return nil
	}, &consumer.Config{Schema: pgtest.Schema(t), MinBackoff: time.Hour, MaxBackoff: time.Hour,
		Hooks: []consumer.Hook{consumerprom.NewHook(reg)}})
	if err != nil {
		t.Fatal(err)
	}
	tr := transport{last: make(chan int64, 10)}
	ctx := context.Background()
	// stop stops a partition, canceling a hanging handler's context
	// after 100ms.
	stop := func(w *consumer.Partition) {
		ctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		w.Stop(ctx)
	}
	w := p.StartPartition(ctx, tr)
	defer stop(w)
	const age = "onceflow_consumer_oldest_in_flight_seconds"
	id := func(s string) []consumer.Header { return []consumer.Header{{Key: "message-id", Value: []byte(s)}} }

	_ = w.Add(ctx, consumer.Message{Topic: "t", Offset: 0, Headers: id("a"), Value: []byte("hang"), Timestamp: time.Now()})
	<-started
	if v, ok := gauge(t, reg, "onceflow_consumer_dead_letters_total"); !ok || v != 0 {
		t.Fatalf("dead letters while the topic's first message is in flight: %v (exposed %v), want 0", v, ok)
	}
	var last float64
	waitFor(t, "the hung handler's age to pass 300ms", func() bool {
		last, _ = gauge(t, reg, age)
		return last >= 0.3
	})
	if v, _ := gauge(t, reg, age); v < last {
		t.Fatalf("%s went from %v to %v while the handler hangs", age, last, v)
	}
	close(release)
	<-tr.last
	if v, ok := gauge(t, reg, age); !ok || v != 0 {
		t.Fatalf("%s with nothing in flight: %v (exposed %v), want 0", age, v, ok)
	}

	// A message that failed waits out its (hour-long) backoff: it is not
	// hung.
	_ = w.Add(ctx, consumer.Message{Topic: "t", Offset: 1, Headers: id("b"), Value: []byte("fail"), Timestamp: time.Now()})
	waitFor(t, "the failed attempt", func() bool {
		v, _ := gauge(t, reg, "onceflow_consumer_retries_total")
		return v == 1
	})
	time.Sleep(200 * time.Millisecond) // the backoff goes on
	if v, _ := gauge(t, reg, age); v != 0 {
		t.Fatalf("%s during a failed message's backoff: %v, want 0", age, v)
	}

	// Stopped in the middle of a hanging attempt: abandoned, not in
	// flight any more.
	stop(w)
	w2 := p.StartPartition(ctx, tr)
	defer stop(w2)
	release = make(chan struct{})
	_ = w2.Add(ctx, consumer.Message{Topic: "t", Offset: 1, Headers: id("c"), Value: []byte("hang"), Timestamp: time.Now()})
	for v := range started {
		if v == "hang" {
			break
		}
	}
	waitFor(t, "the second hung handler's age to show", func() bool {
		v, _ := gauge(t, reg, age)
		return v > 0
	})
	stop(w2)
	if v, _ := gauge(t, reg, age); v != 0 {
		t.Fatalf("%s after the partition stopped: %v, want 0 (the message was abandoned)", age, v)
	}
}
