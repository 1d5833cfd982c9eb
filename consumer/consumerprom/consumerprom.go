// Package consumerprom exposes an idempotent consumer's metrics to
// Prometheus through consumer hooks:
//
//	hook := consumerprom.NewHook(prometheus.DefaultRegisterer)
//	p, err := consumer.New(pool, "ledger", handle, &consumer.Config{Hooks: []consumer.Hook{hook}})
//
// Metrics, each labelled by consumer name:
//
//   - onceflow_consumer_messages_total{outcome="processed|duplicate|dead-lettered"}
//   - onceflow_consumer_retries_total: failed attempts that will be retried
//   - onceflow_consumer_dead_letters_total{topic}: records published to a
//     dead-letter topic
//   - onceflow_consumer_transaction_seconds{mode="message|batch"}: begin to
//     commit of a committed transaction, the handler latency as the
//     database sees it
package consumerprom

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/consumer"
)

// Hook implements consumer.HookDone, consumer.HookRetry,
// consumer.HookDeadLetter and consumer.HookBatch. It is safe for concurrent use; one Hook may
// serve several Processors.
type Hook struct {
	messages *prometheus.CounterVec
	retries  *prometheus.CounterVec
	dead     *prometheus.CounterVec
	txn      *prometheus.HistogramVec
}

var (
	_ consumer.HookDone       = (*Hook)(nil)
	_ consumer.HookRetry      = (*Hook)(nil)
	_ consumer.HookDeadLetter = (*Hook)(nil)
	_ consumer.HookBatch      = (*Hook)(nil)
)

// NewHook registers the consumer metrics with reg.
func NewHook(reg prometheus.Registerer) *Hook {
	h := &Hook{
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "onceflow_consumer_messages_total",
			Help: "Messages finished, by outcome: processed (handler committed), duplicate (skipped), dead-lettered."}, []string{"consumer", "outcome"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "onceflow_consumer_retries_total",
			Help: "Failed handler attempts that will be retried."}, []string{"consumer"}),
		dead: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "onceflow_consumer_dead_letters_total",
			Help: "Messages published to a dead-letter topic."}, []string{"consumer", "topic"}),
		txn: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "onceflow_consumer_transaction_seconds",
			Help:    "Begin to commit of committed consumer transactions (dedup record plus handler).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}, []string{"consumer", "mode"}),
	}
	reg.MustRegister(h.messages, h.retries, h.dead, h.txn)
	return h
}

// OnDone implements consumer.HookDone.
func (h *Hook) OnDone(e consumer.DoneEvent) {
	h.messages.WithLabelValues(e.Consumer, e.Outcome.String()).Inc()
	if e.Outcome == consumer.Processed && e.BatchSize == 1 {
		h.txn.WithLabelValues(e.Consumer, "message").Observe(e.Duration.Seconds())
	}
}

// OnBatch implements consumer.HookBatch.
func (h *Hook) OnBatch(e consumer.BatchEvent) {
	h.txn.WithLabelValues(e.Consumer, "batch").Observe(e.Duration.Seconds())
}

// OnRetry implements consumer.HookRetry.
func (h *Hook) OnRetry(e consumer.RetryEvent) { h.retries.WithLabelValues(e.Consumer).Inc() }

// OnDeadLetter implements consumer.HookDeadLetter.
func (h *Hook) OnDeadLetter(e consumer.DeadLetterEvent) {
	h.dead.WithLabelValues(e.Consumer, e.Topic).Inc()
}
