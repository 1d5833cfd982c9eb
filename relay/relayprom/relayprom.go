// Package relayprom exposes a relay's metrics to Prometheus: an Observer for
// what the relay does, and a Collector that reads backlog figures from the
// database at scrape time.
package relayprom

import (
	"context"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/relay"
)

// Observer counts the relay's work. Safe for concurrent use.
type Observer struct {
	published    prometheus.Counter
	failed       prometheus.Counter
	timedOut     prometheus.Counter
	deadLettered prometheus.Counter
	notDeleted   prometheus.Counter
	ownedShards  prometheus.Gauge
	roundSeconds prometheus.Histogram
	lagSeconds   prometheus.Histogram
	dwellSeconds prometheus.Histogram
}

var (
	_ relay.Observer      = (*Observer)(nil)
	_ relay.EventObserver = (*Observer)(nil)
)

// NewObserver registers the relay's metrics with reg.
func NewObserver(reg prometheus.Registerer) *Observer {
	o := &Observer{
		published:    prometheus.NewCounter(prometheus.CounterOpts{Name: "onceflow_relay_published_total", Help: "Events acknowledged by Kafka and removed from the outbox."}),
		failed:       prometheus.NewCounter(prometheus.CounterOpts{Name: "onceflow_relay_failures_total", Help: "Event publish attempts that failed with a passing error and will be retried."}),
		timedOut:     prometheus.NewCounter(prometheus.CounterOpts{Name: "onceflow_relay_publish_timeouts_total", Help: "Event publish attempts not acknowledged within the publish timeout (also counted in failures); the key is retried beside the others."}),
		deadLettered: prometheus.NewCounter(prometheus.CounterOpts{Name: "onceflow_relay_dead_lettered_total", Help: "Events Kafka refused for good, moved to outbox_dead."}),
		notDeleted:   prometheus.NewCounter(prometheus.CounterOpts{Name: "onceflow_relay_ownership_lost_total", Help: "Published events left for the new shard owner after this relay lost ownership mid-round."}),
		ownedShards:  prometheus.NewGauge(prometheus.GaugeOpts{Name: "onceflow_relay_owned_shards", Help: "Shards this relay owns."}),
		roundSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "onceflow_relay_round_seconds", Help: "Duration of a publish round (read, publish, record).", Buckets: prometheus.ExponentialBuckets(0.001, 2, 14)}),
		lagSeconds:   prometheus.NewHistogram(prometheus.HistogramOpts{Name: "onceflow_relay_oldest_published_age_seconds", Help: "Age of the oldest event in each round at publish time.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 18)}),
		dwellSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "onceflow_outbox_dwell_seconds", Help: "Time each published event spent in the outbox, from its write to Kafka's acknowledgement.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 18)}),
	}
	reg.MustRegister(o.published, o.failed, o.timedOut, o.deadLettered, o.notDeleted, o.ownedShards, o.roundSeconds, o.lagSeconds, o.dwellSeconds)
	return o
}

// ObserveBatch implements relay.Observer.
func (o *Observer) ObserveBatch(s relay.BatchStats) {
	o.published.Add(float64(s.Published))
	o.failed.Add(float64(s.Failed))
	o.timedOut.Add(float64(s.TimedOut))
	o.deadLettered.Add(float64(s.DeadLettered))
	o.notDeleted.Add(float64(s.NotDeleted))
	o.roundSeconds.Observe(s.Duration.Seconds())
	if !s.OldestCreatedAt.IsZero() {
		o.lagSeconds.Observe(time.Since(s.OldestCreatedAt).Seconds())
	}
}

// ObservePublished implements relay.EventObserver: one observation of
// onceflow_outbox_dwell_seconds per acknowledged event.
func (o *Observer) ObservePublished(e relay.PublishedEvent) {
	o.dwellSeconds.Observe(max(e.Acked.Sub(e.CreatedAt), 0).Seconds())
}

// ObserveShards implements relay.Observer.
func (o *Observer) ObserveShards(owned int) { o.ownedShards.Set(float64(owned)) }

// BacklogCollector reads from the database at each scrape (with a timeout)
// the backlog per shard and in all, its age, the highest attempt count of a
// pending event, the dead-letter count and the shards without an owner.
// Every relay reports the same figures: aggregate them with max, not sum.
type BacklogCollector struct {
	db      relay.Querier
	schema  string
	timeout time.Duration

	backlog, oldest, dead, total, attempts, unowned, up *prometheus.Desc
}

// NewBacklogCollector returns a collector for schema; register it yourself.
func NewBacklogCollector(db relay.Querier, schema string) *BacklogCollector {
	return &BacklogCollector{
		db: db, schema: schema, timeout: 5 * time.Second,
		backlog:  prometheus.NewDesc("onceflow_outbox_backlog", "Pending events per shard.", []string{"shard"}, nil),
		oldest:   prometheus.NewDesc("onceflow_outbox_oldest_pending_age_seconds", "Age of the oldest pending event per shard.", []string{"shard"}, nil),
		total:    prometheus.NewDesc("onceflow_outbox_backlog_events", "Pending events in all shards.", nil, nil),
		dead:     prometheus.NewDesc("onceflow_outbox_dead_events", "Events in outbox_dead.", nil, nil),
		attempts: prometheus.NewDesc("onceflow_outbox_max_attempts", "Highest publish attempt count of a pending event: an event stuck on a failure keeps raising it.", nil, nil),
		unowned:  prometheus.NewDesc("onceflow_outbox_unowned_shards", "Shards no live relay holds a lease on.", nil, nil),
		up:       prometheus.NewDesc("onceflow_outbox_scrape_ok", "1 if the backlog could be read from the database.", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *BacklogCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.backlog, c.oldest, c.total, c.dead, c.attempts, c.unowned, c.up} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *BacklogCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	shards, err := relay.ReadShardBacklog(ctx, c.db, c.schema)
	var st *relay.Status
	if err == nil {
		st, err = relay.ReadStatus(ctx, c.db, c.schema)
	}
	if err != nil {
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 1)
	now := time.Now()
	for _, s := range shards {
		label := strconv.Itoa(int(s.Shard))
		ch <- prometheus.MustNewConstMetric(c.backlog, prometheus.GaugeValue, float64(s.Pending), label)
		ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, now.Sub(s.OldestPending).Seconds(), label)
	}
	ch <- prometheus.MustNewConstMetric(c.total, prometheus.GaugeValue, float64(st.Backlog))
	ch <- prometheus.MustNewConstMetric(c.dead, prometheus.GaugeValue, float64(st.DeadLetters))
	ch <- prometheus.MustNewConstMetric(c.attempts, prometheus.GaugeValue, float64(st.MaxAttempts))
	ch <- prometheus.MustNewConstMetric(c.unowned, prometheus.GaugeValue, float64(st.UnownedShards))
}
