// Package consumerprom exposes an idempotent consumer's metrics to
// Prometheus through consumer hooks:
//
//	hook := consumerprom.NewHook(prometheus.DefaultRegisterer)
//	p, err := consumer.New(pool, "ledger", handle, &consumer.Config{Hooks: []consumer.Hook{hook}})
//
// Metrics, each labelled by consumer name; topic is the consumed topic:
//
//   - onceflow_consumer_messages_total{topic,outcome="processed|duplicate|dead-lettered"}
//   - onceflow_consumer_retries_total{topic}: failed attempts that will be
//     retried (handler errors, connections lost in a transaction, and
//     waits for an unreachable database, which spend no budget)
//   - onceflow_consumer_dead_letters_total{topic}: messages of topic
//     published to its dead-letter topic
//   - onceflow_consumer_lag_seconds{topic,partition}: age of the record
//     finished last in the partition (now minus its Kafka timestamp), the
//     consumer's time lag; it holds its value while nothing is finished
//   - onceflow_consumer_dead_letter_failures_total{topic,reason="topic-missing|too-large|other"}:
//     failed publishes of topic's dead letters; the message's partition
//     waits while they go on. Alert on any topic-missing or too-large
//     failure: they last until the dead-letter topic is created, or its
//     max.message.bytes raised (a dead letter too large even without the
//     original's value, headers and long key, and with its error cut)
//   - onceflow_consumer_transaction_seconds{mode="message|batch"}: begin to
//     commit of a committed transaction, the handler latency as the
//     database sees it
//   - onceflow_consumer_oldest_in_flight_seconds{topic}: how long the
//     longest-running attempt at a message of topic in the consumer's hands
//     has run (since the message was taken, or since the backoff after its
//     last failed attempt; its dead-letter publish included); 0 when none
//     is in flight. A handler that hangs (a lock wait, a call with no
//     deadline) shows here, and nowhere else: the lag gauge holds the last
//     finished message's lag, and nothing finishes or retries
package consumerprom

import (
	"context"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/consumer"
)

// Hook implements consumer.HookDone, consumer.HookRetry,
// consumer.HookDeadLetter, consumer.HookDeadLetterFailed,
// consumer.HookBatch and, to know which messages are in flight,
// consumer.HookTrace. It is safe for concurrent use; one Hook may serve
// several Processors.
type Hook struct {
	messages *prometheus.CounterVec
	retries  *prometheus.CounterVec
	dead     *prometheus.CounterVec
	lag      *prometheus.GaugeVec
	dlqFail  *prometheus.CounterVec
	txn      *prometheus.HistogramVec
	byTopic  sync.Map // [2]string{consumer, topic} -> *topicCounters
}

var (
	_ consumer.HookDone       = (*Hook)(nil)
	_ consumer.HookRetry      = (*Hook)(nil)
	_ consumer.HookDeadLetter = (*Hook)(nil)
	_ consumer.HookBatch      = (*Hook)(nil)
	_ consumer.HookTrace      = (*Hook)(nil)

	_ consumer.HookDeadLetterFailed = (*Hook)(nil)
)

// NewHook registers the consumer metrics with reg.
func NewHook(reg prometheus.Registerer) *Hook {
	h := &Hook{
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "onceflow_consumer_messages_total",
			Help: "Messages finished, by outcome: processed (handler committed), duplicate (skipped), dead-lettered."}, []string{"consumer", "topic", "outcome"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "onceflow_consumer_retries_total",
			Help: "Failed attempts that will be retried: handler errors, connections lost in a transaction, and waits for an unreachable database."}, []string{"consumer", "topic"}),
		dead: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "onceflow_consumer_dead_letters_total",
			Help: "Messages published to their dead-letter topic, by the topic they came from."}, []string{"consumer", "topic"}),
		lag: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "onceflow_consumer_lag_seconds",
			Help: "Age (now minus Kafka timestamp) of the record finished last in the partition."}, []string{"consumer", "topic", "partition"}),
		dlqFail: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "onceflow_consumer_dead_letter_failures_total",
			Help: "Failed publishes of dead letters (retried; the message's partition waits), by the topic they came from. reason=topic-missing lasts until the dead-letter topic is created; reason=too-large until its max.message.bytes is raised."}, []string{"consumer", "topic", "reason"}),
		txn: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "onceflow_consumer_transaction_seconds",
			Help:    "Begin to commit of committed consumer transactions (dedup record plus handler).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}, []string{"consumer", "mode"}),
	}
	inFlight := inFlightCollector{h: h, desc: prometheus.NewDesc("onceflow_consumer_oldest_in_flight_seconds",
		"How long the longest-running attempt at a message in flight has run: since the message was taken, or since the backoff after its last failed attempt (its dead-letter publish included); 0 with none in flight.",
		[]string{"consumer", "topic"}, nil)}
	reg.MustRegister(h.messages, h.retries, h.dead, h.lag, h.dlqFail, h.txn, inFlight)
	return h
}

// OnDone implements consumer.HookDone.
func (h *Hook) OnDone(e consumer.DoneEvent) {
	m := &e.Message
	c := h.counters(e.Consumer, m.Topic)
	if e.Outcome >= consumer.Processed && e.Outcome <= consumer.DeadLettered {
		c.outcomes[e.Outcome].Inc()
	}
	if !m.Timestamp.IsZero() {
		h.lag.WithLabelValues(e.Consumer, m.Topic, strconv.Itoa(int(m.Partition))).Set(max(time.Since(m.Timestamp).Seconds(), 0))
	}
	if e.Outcome == consumer.Processed && !e.Batched { // OnBatch times batch transactions
		h.txn.WithLabelValues(e.Consumer, "message").Observe(e.Duration.Seconds())
	}
}

// OnBatch implements consumer.HookBatch.
func (h *Hook) OnBatch(e consumer.BatchEvent) {
	if e.New == 0 {
		return // every message a duplicate: rolled back, not committed
	}
	h.txn.WithLabelValues(e.Consumer, "batch").Observe(e.Duration.Seconds())
}

// OnRetry implements consumer.HookRetry.
func (h *Hook) OnRetry(e consumer.RetryEvent) {
	h.counters(e.Consumer, e.Message.Topic).retries.Inc()
}

// topicCounters are one (consumer, topic)'s counters, created together at
// 0 when the consumer takes the topic's first message (TraceStart), before
// any outcome, so that rate() and increase() see the topic's retries, dead
// letters and dead-letter failures once a scrape has seen them at 0. A
// topic's first message since the process started may still be
// dead-lettered before the next scrape, and its counter first scraped at 1:
// increase() shows no such series, so alert rules count a new series above
// 0 themselves, as deploy/prometheus's dead-letter alert does.
type topicCounters struct {
	outcomes      [consumer.DeadLettered + 1]prometheus.Counter
	retries, dead prometheus.Counter

	mu      sync.Mutex
	flights map[*flight]struct{} // the topic's messages in flight
}

func (h *Hook) counters(name, topic string) *topicCounters {
	k := [2]string{name, topic}
	if c, ok := h.byTopic.Load(k); ok {
		return c.(*topicCounters)
	}
	c := &topicCounters{
		retries: h.retries.WithLabelValues(name, topic),
		dead:    h.dead.WithLabelValues(name, topic),
		flights: make(map[*flight]struct{}),
	}
	for _, o := range []consumer.Outcome{consumer.Processed, consumer.Duplicate, consumer.DeadLettered} {
		c.outcomes[o] = h.messages.WithLabelValues(name, topic, o.String())
	}
	// At 0 from the topic's first message on (see topicCounters).
	for _, reason := range []string{"topic-missing", "too-large", "other"} {
		h.dlqFail.WithLabelValues(name, topic, reason)
	}
	got, _ := h.byTopic.LoadOrStore(k, c)
	return got.(*topicCounters)
}

// OnDeadLetter implements consumer.HookDeadLetter.
func (h *Hook) OnDeadLetter(e consumer.DeadLetterEvent) {
	h.counters(e.Consumer, e.Message.Topic).dead.Inc()
}

// OnDeadLetterFailed implements consumer.HookDeadLetterFailed.
func (h *Hook) OnDeadLetterFailed(e consumer.DeadLetterFailedEvent) {
	reason := "other"
	switch {
	case e.TopicMissing:
		reason = "topic-missing"
	case e.TooLarge:
		reason = "too-large"
	}
	h.counters(e.Consumer, e.Message.Topic) // made by TraceStart, unless a wrapper left it out
	h.dlqFail.WithLabelValues(e.Consumer, e.Message.Topic, reason).Inc()
}

// flight is a message in the consumer's hands, from TraceStart to TraceEnd.
type flight struct {
	c *topicCounters
	// since is when its current attempt began; guarded by c.mu.
	since time.Time
}

// flightKey finds a Hook's flight in a message's context.
type flightKey struct{ h *Hook }

// TraceStart implements consumer.HookTrace: the message is in flight from
// now, and its topic's counters exist (at 0) before its outcome.
func (h *Hook) TraceStart(ctx context.Context, e consumer.TraceStartEvent) context.Context {
	c := h.counters(e.Consumer, e.Message.Topic)
	f := &flight{c: c, since: time.Now()}
	c.mu.Lock()
	c.flights[f] = struct{}{}
	c.mu.Unlock()
	return context.WithValue(ctx, flightKey{h}, f)
}

// TraceRetry implements consumer.HookTrace: the message's next attempt
// begins after the backoff, so a message that keeps failing, however long
// its backoffs, is not taken for hung.
func (h *Hook) TraceRetry(ctx context.Context, e consumer.RetryEvent) {
	if f, ok := ctx.Value(flightKey{h}).(*flight); ok {
		f.c.mu.Lock()
		f.since = time.Now().Add(e.Backoff)
		f.c.mu.Unlock()
	}
}

// TraceEnd implements consumer.HookTrace: the message is finished or
// abandoned.
func (h *Hook) TraceEnd(ctx context.Context, _ consumer.TraceEndEvent) {
	if f, ok := ctx.Value(flightKey{h}).(*flight); ok {
		f.c.mu.Lock()
		delete(f.c.flights, f)
		f.c.mu.Unlock()
	}
}

// inFlightCollector reports onceflow_consumer_oldest_in_flight_seconds
// at scrape time, for every (consumer, topic) seen.
type inFlightCollector struct {
	h    *Hook
	desc *prometheus.Desc
}

func (c inFlightCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c inFlightCollector) Collect(ch chan<- prometheus.Metric) {
	now := time.Now()
	c.h.byTopic.Range(func(k, v any) bool {
		key, tc := k.([2]string), v.(*topicCounters)
		var age time.Duration
		tc.mu.Lock()
		for f := range tc.flights {
			age = max(age, now.Sub(f.since))
		}
		tc.mu.Unlock()
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, age.Seconds(), key[0], key[1])
		return true
	})
}
