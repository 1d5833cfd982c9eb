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
package consumerprom

import (
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/consumer"
)

// Hook implements consumer.HookDone, consumer.HookRetry,
// consumer.HookDeadLetter, consumer.HookDeadLetterFailed and
// consumer.HookBatch. It is safe for concurrent use; one Hook may
// serve several Processors.
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
	reg.MustRegister(h.messages, h.retries, h.dead, h.lag, h.dlqFail, h.txn)
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
// 0 by the topic's first event, so that rate() and increase() see the
// topic's later retries, dead letters and dead-letter failures. That first
// event's own counter is born at 1, and Prometheus may first scrape it so
// (a topic's first message since the process started, dead-lettered at
// once): increase() shows no such series, and alert rules must count a new
// series above 0 themselves, as deploy/prometheus's dead-letter alert does.
type topicCounters struct {
	outcomes      [consumer.DeadLettered + 1]prometheus.Counter
	retries, dead prometheus.Counter
}

func (h *Hook) counters(name, topic string) *topicCounters {
	k := [2]string{name, topic}
	if c, ok := h.byTopic.Load(k); ok {
		return c.(*topicCounters)
	}
	c := &topicCounters{
		retries: h.retries.WithLabelValues(name, topic),
		dead:    h.dead.WithLabelValues(name, topic),
	}
	for _, o := range []consumer.Outcome{consumer.Processed, consumer.Duplicate, consumer.DeadLettered} {
		c.outcomes[o] = h.messages.WithLabelValues(name, topic, o.String())
	}
	// At 0 from the topic's first event on (see topicCounters).
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
	h.counters(e.Consumer, e.Message.Topic) // a message with no id fails here first
	h.dlqFail.WithLabelValues(e.Consumer, e.Message.Topic, reason).Inc()
}
