package main

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// brokerOutage is how long TestRelayWaitsOutBrokerOutage keeps the broker down.
const brokerOutage = 30 * time.Second

// TestRelayWaitsOutBrokerOutage stops a real broker (its own, from
// scripts/kafka.sh) for 30 s under a running relay while events keep being
// written. While the broker is down the relay's /metrics show the events
// waiting (backlog and its age) and nothing is dead-lettered; once the
// broker is back the relay catches up by itself: every event is in the topic
// once at least, the outbox is empty. It needs the real broker setup of
// `make test-kafka`; kfake runs inside the test process and cannot be stopped
// as a process. The relay also says so itself: onceflow_relay_kafka_up 0
// while the broker is down (1 again after) and a Warn that it cannot reach
// any Kafka broker.
func TestRelayWaitsOutBrokerOutage(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary and a broker; skipped with -short")
	}
	b := kafkatest.NewBroker(t)
	bin := buildBinary(t)
	schema := pgtest.Schema(t)
	topic := b.Topic(t, 4)
	addr := freeAddr(t)
	env := relayEnv(t, schema, &b.Kafka)
	p := startRelayProc(t, bin, env, "--http-addr", addr, "--log-level", "info", "--poll-interval", "100ms", "--lease-duration", "2s", "--kafka-check-interval", "1s")
	waitUntil(t, "the relay to start", 60*time.Second, relayStarted(p))
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("relay output:\n%s", p.Output())
		}
	})

	w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
	ctx := context.Background()
	pool := pgtest.Pool(t)
	ids := map[string]bool{}
	write := func(n int) {
		t.Helper()
		msgs := make([]outbox.Message, n)
		for i := range msgs {
			id := outbox.NewID()
			ids[id] = true
			msgs[i] = outbox.Message{ID: id, Topic: topic, Key: []byte(fmt.Sprint(i % 7)), Value: []byte(id)}
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return w.Write(ctx, tx, msgs...) }); err != nil {
			t.Fatal(err)
		}
	}
	write(100)
	waitUntil(t, "the outbox to drain before the outage", 60*time.Second, func() bool { return count(t, schema, "outbox") == 0 })

	b.Stop(t)
	down := time.Now()
	outputBefore := len(p.Output())
	write(100)
	var backlog, age, failures float64
	minUp := 1.0
	for time.Since(down) < brokerOutage {
		if err, exited := p.Exited(); exited {
			t.Fatalf("the relay exited while the broker was down: %v", err)
		}
		_, m := httpGet("http://" + addr + "/metrics")
		backlog = max(backlog, sumMetric(m, "onceflow_outbox_backlog"))
		age = max(age, maxMetric(m, "onceflow_outbox_oldest_pending_age_seconds"))
		failures = max(failures, metric(m, "onceflow_relay_failures_total"))
		if strings.Contains(m, "\nonceflow_relay_kafka_up ") {
			minUp = min(minUp, metric(m, "onceflow_relay_kafka_up"))
		}
		if dead := metric(m, "onceflow_relay_dead_lettered_total"); dead != 0 {
			t.Fatalf("%v events dead-lettered while the broker was down", dead)
		}
		time.Sleep(500 * time.Millisecond)
	}
	if backlog < 100 || age < 5 {
		t.Errorf("while the broker was down, /metrics showed at most %v events waiting, the oldest %.1fs old; want the 100 written, growing old", backlog, age)
	}
	during := p.Output()[outputBefore:]
	warns := strings.Count(during, "level=WARN")
	t.Logf("broker down %.0fs: /metrics showed %v events waiting (oldest %.1fs), onceflow_relay_kafka_up %v at lowest, onceflow_relay_failures_total %v; the relay logged %d Warn lines:\n%s",
		time.Since(down).Seconds(), backlog, age, minUp, failures, warns, tailLines(during, 10))

	// The relay said the broker was down: in the gauge and at Warn.
	if minUp != 0 {
		t.Errorf("onceflow_relay_kafka_up never 0 during a %v outage (lowest seen %v)", brokerOutage, minUp)
	}
	if !strings.Contains(during, "level=WARN") || !strings.Contains(during, "cannot reach any Kafka broker") {
		t.Errorf("the relay logged no Warn that it cannot reach any Kafka broker during a %v outage", brokerOutage)
	}

	b.Start(t)
	t.Logf("broker back after %.0fs", time.Since(down).Seconds())
	waitUntil(t, "onceflow_relay_kafka_up back to 1", 2*time.Minute, func() bool {
		_, m := httpGet("http://" + addr + "/metrics")
		return metric(m, "onceflow_relay_kafka_up") == 1
	})
	waitUntil(t, "the relay to catch up after the outage", 3*time.Minute, func() bool { return count(t, schema, "outbox") == 0 })
	if n := count(t, schema, "outbox_dead"); n != 0 {
		t.Errorf("%d events dead-lettered", n)
	}
	got := map[string]bool{}
	for _, r := range b.ReadAll(t, topic, len(ids), time.Minute) {
		for _, h := range r.Headers {
			if h.Key == relay.MessageIDHeader {
				got[string(h.Value)] = true
			}
		}
	}
	for id := range ids {
		if !got[id] {
			t.Errorf("event %s not in the topic after the outage", id)
		}
	}
	_ = p.Signal(syscall.SIGTERM)
	if err, exited := p.Wait(30 * time.Second); !exited || err != nil {
		t.Fatalf("after SIGTERM: exited %v, err %v", exited, err)
	}
}

// metric returns the value of an unlabelled sample in a Prometheus text
// exposition, 0 if absent.
func metric(exposition, name string) float64 {
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + ` (\S+)$`).FindStringSubmatch(exposition)
	if m == nil {
		return 0
	}
	v, _ := strconv.ParseFloat(m[1], 64)
	return v
}

// maxMetric returns the largest value of a labelled metric's samples.
func maxMetric(exposition, name string) float64 {
	var out float64
	for _, v := range samples(exposition, name) {
		out = max(out, v)
	}
	return out
}

// sumMetric returns the sum of a labelled metric's samples.
func sumMetric(exposition, name string) float64 {
	var out float64
	for _, v := range samples(exposition, name) {
		out += v
	}
	return out
}

func samples(exposition, name string) []float64 {
	var out []float64
	for _, m := range regexp.MustCompile(`(?m)^`+regexp.QuoteMeta(name)+`\{[^}]*\} (\S+)$`).FindAllStringSubmatch(exposition, -1) {
		v, _ := strconv.ParseFloat(m[1], 64)
		out = append(out, v)
	}
	return out
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
