// Package relayprom exposes a relay's metrics to Prometheus: an Observer for
// what the relay does, and a Collector that reads backlog figures from the
// database at scrape time.
package relayprom

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/relay"
)

// Observer counts the relay's work. Safe for concurrent use.
type Observer struct {
	published    prometheus.Counter
	failed       prometheus.Counter
	timedOut     prometheus.Counter
	heldBack     prometheus.Counter
	sick         prometheus.GaugeFunc
	deadLettered prometheus.Counter
	notDeleted   prometheus.Counter
	ownedShards  prometheus.Gauge
	roundSeconds prometheus.Histogram
	lagSeconds   prometheus.Histogram
	dwellSeconds prometheus.Histogram

	// The sick partitions: the sum of the changes relays report
	// (SickPartitionsChanged), plus the last BatchStats count of a relay
	// that does not report them (behind a wrapper that does not pass them
	// on; several such relays overwrite one another, as before).
	sickSum, sickUnreported atomic.Int64
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
		heldBack:     prometheus.NewCounter(prometheus.CounterOpts{Name: "onceflow_relay_sick_partition_held_back_total", Help: "Events not sent in a round because their key's partition is marked sick (also counted in failures); one probe retries the partition."}),
		deadLettered: prometheus.NewCounter(prometheus.CounterOpts{Name: "onceflow_relay_dead_lettered_total", Help: "Events Kafka refused for good, moved to outbox_dead."}),
		notDeleted:   prometheus.NewCounter(prometheus.CounterOpts{Name: "onceflow_relay_ownership_lost_total", Help: "Published events left for the new shard owner after this relay lost ownership mid-round."}),
		ownedShards:  prometheus.NewGauge(prometheus.GaugeOpts{Name: "onceflow_relay_owned_shards", Help: "Shards this relay owns."}),
		roundSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "onceflow_relay_round_seconds", Help: "Duration of a publish round (read, publish, record), or of a side retry of a sick partition's keys (up to the publish timeout).", Buckets: prometheus.ExponentialBuckets(0.001, 2, 14)}),
		lagSeconds:   prometheus.NewHistogram(prometheus.HistogramOpts{Name: "onceflow_relay_oldest_published_age_seconds", Help: "Age of the oldest event in each round at publish time.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 18)}),
		dwellSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "onceflow_outbox_dwell_seconds", Help: "Time each published event spent in the outbox, from its write to Kafka's acknowledgement.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 18)}),
	}
	o.sick = prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "onceflow_relay_sick_partitions", Help: "Partitions marked sick: a record sent there was not acknowledged (in time, or with a passing error) and none since (summed over the relays reporting to this Observer)."},
		func() float64 { return float64(o.sickSum.Load() + o.sickUnreported.Load()) })
	reg.MustRegister(o.published, o.failed, o.timedOut, o.heldBack, o.sick, o.deadLettered, o.notDeleted, o.ownedShards, o.roundSeconds, o.lagSeconds, o.dwellSeconds)
	return o
}

// ObserveBatch implements relay.Observer.
func (o *Observer) ObserveBatch(s relay.BatchStats) {
	o.published.Add(float64(s.Published))
	o.failed.Add(float64(s.Failed))
	o.timedOut.Add(float64(s.TimedOut))
	o.heldBack.Add(float64(s.HeldBack))
	if !s.SickPartitionsReported {
		o.sickUnreported.Store(int64(s.SickPartitions))
	}
	o.deadLettered.Add(float64(s.DeadLettered))
	o.notDeleted.Add(float64(s.NotDeleted))
	o.roundSeconds.Observe(s.Duration.Seconds())
	if !s.OldestCreatedAt.IsZero() {
		// Clamped as dwell is: created_at is the database's clock, and a
		// negative observation would make the histogram's _sum go down.
		o.lagSeconds.Observe(max(time.Since(s.OldestCreatedAt), 0).Seconds())
	}
}

// ObservePublished implements relay.EventObserver: one observation of
// onceflow_outbox_dwell_seconds per acknowledged event.
func (o *Observer) ObservePublished(e relay.PublishedEvent) {
	o.dwellSeconds.Observe(max(e.Acked.Sub(e.CreatedAt), 0).Seconds())
}

// SickPartitionsChanged implements relay.SickPartitionObserver: the gauge
// sums the changes of every relay that reports to this Observer.
func (o *Observer) SickPartitionsChanged(delta int) { o.sickSum.Add(int64(delta)) }

// ObserveShards implements relay.Observer.
func (o *Observer) ObserveShards(owned int) { o.ownedShards.Set(float64(owned)) }

// BacklogCollector reads the outbox's figures from the database, at most
// once per CollectorConfig.MinInterval (a faster scrape gets the last
// reading again), with a timeout, at a cost that does not grow with the
// backlog (relay.ReadBacklog: a few index descents per shard).
//
// Each relay reports the shards it owns: onceflow_outbox_backlog{shard},
// onceflow_outbox_oldest_pending_age_seconds{shard} and their total
// onceflow_outbox_backlog_events, so a sum across relays is the outbox's
// backlog (shards no relay owns are counted by nobody, and
// onceflow_outbox_unowned_shards says how many there are). A shard's count
// is exact while it holds few events and an estimate beyond that;
// onceflow_outbox_backlog_estimated_shards says how many of the figures are
// estimates. onceflow_outbox_max_attempts is the highest over the first
// events of each owned shard (aggregate with max);
// onceflow_outbox_dead_events and onceflow_outbox_unowned_shards are
// database-wide, the same in every relay (aggregate with max).
//
// Safe for concurrent use.
type BacklogCollector struct {
	db     relay.Querier
	schema string
	cfg    CollectorConfig

	mu      sync.Mutex // held while reading, so concurrent scrapes read once
	last    *relay.Backlog
	at      time.Time // when last was read
	ok      bool      // whether the last read succeeded
	lastErr string    // the last read's error, logged once

	backlog, oldest, dead, total, estimated, attempts, unowned, up *prometheus.Desc
}

// CollectorConfig configures a BacklogCollector.
type CollectorConfig struct {
	// Owned returns the shards this process reports (a relay's
	// relay.Relay.OwnedShards). Nil reports every shard: for one collector
	// per deployment outside the relays, never beside relays that report
	// theirs. Defaults to nil.
	Owned func() []int16
	// MinInterval is the shortest time between two database reads: a
	// scrape sooner than that after the last read reports that read again.
	// Defaults to 5 s.
	MinInterval time.Duration
	// Timeout bounds one database read. Defaults to 5 s.
	Timeout time.Duration
	// Logger is told why a read failed (Warn, once for each new error:
	// a missing grant, the database away) and when reads succeed again
	// (Info). Defaults to slog.Default().
	Logger *slog.Logger
}

// NewBacklogCollector returns a collector for schema; register it yourself.
// cfg may be nil.
func NewBacklogCollector(db relay.Querier, schema string, cfg *CollectorConfig) *BacklogCollector {
	c := &BacklogCollector{db: db, schema: schema}
	if cfg != nil {
		c.cfg = *cfg
	}
	if c.cfg.MinInterval <= 0 {
		c.cfg.MinInterval = 5 * time.Second
	}
	if c.cfg.Timeout <= 0 {
		c.cfg.Timeout = 5 * time.Second
	}
	if c.cfg.Logger == nil {
		c.cfg.Logger = slog.Default()
	}
	estimate := fmt.Sprintf(" Exact while the shard holds fewer than %d events between two of %d evenly spaced ids, estimated beyond.", relay.BacklogProbeRows, relay.BacklogProbes)
	c.backlog = prometheus.NewDesc("onceflow_outbox_backlog", "Pending events per shard this relay owns (sum across relays)."+estimate, []string{"shard"}, nil)
	c.oldest = prometheus.NewDesc("onceflow_outbox_oldest_pending_age_seconds", "Age of the oldest of the first pending events per shard this relay owns.", []string{"shard"}, nil)
	c.total = prometheus.NewDesc("onceflow_outbox_backlog_events", "Pending events in the shards this relay owns (sum across relays); estimated in part when onceflow_outbox_backlog_estimated_shards > 0.", nil, nil)
	c.estimated = prometheus.NewDesc("onceflow_outbox_backlog_estimated_shards", "Shards this relay owns whose onceflow_outbox_backlog is an estimate.", nil, nil)
	c.dead = prometheus.NewDesc("onceflow_outbox_dead_events", fmt.Sprintf("Events in outbox_dead (every relay reports it); PostgreSQL's estimate from %d on.", relay.DeadExactLimit), nil, nil)
	c.attempts = prometheus.NewDesc("onceflow_outbox_max_attempts", "Highest publish attempt count among the first pending events of the shards this relay owns: an event stuck on a failure keeps raising it.", nil, nil)
	c.unowned = prometheus.NewDesc("onceflow_outbox_unowned_shards", "Shards no live relay holds a lease on (every relay reports it).", nil, nil)
	c.up = prometheus.NewDesc("onceflow_outbox_scrape_ok", "1 if the backlog could be read from the database.", nil, nil)
	return c
}

// Describe implements prometheus.Collector.
func (c *BacklogCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.backlog, c.oldest, c.total, c.estimated, c.dead, c.attempts, c.unowned, c.up} {
		ch <- d
	}
}

// read returns the last reading, reading again if it is older than
// MinInterval.
func (c *BacklogCollector) read() (b *relay.Backlog, ok bool, at time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.at.IsZero() && time.Since(c.at) < c.cfg.MinInterval {
		return c.last, c.ok, c.at
	}
	shards := relay.EveryShard()
	if c.cfg.Owned != nil {
		shards = c.cfg.Owned()
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.Timeout)
	defer cancel()
	// Taken before the read, as Backlog.ReadAt is at its first statement:
	// the ages after it are the database's plus the time since.
	start := time.Now()
	b, err := relay.ReadBacklog(ctx, c.db, c.schema, shards)
	c.at, c.ok = start, err == nil
	switch {
	case err == nil:
		c.last = b
		if c.lastErr != "" {
			c.lastErr = ""
			c.cfg.Logger.Info("relayprom: the backlog is read again")
		}
	case err.Error() != c.lastErr:
		c.lastErr = err.Error()
		c.cfg.Logger.Warn("relayprom: the backlog could not be read; onceflow_outbox_scrape_ok is 0", "error", err)
	}
	return b, c.ok, c.at
}

// Collect implements prometheus.Collector.
func (c *BacklogCollector) Collect(ch chan<- prometheus.Metric) {
	b, ok, readAt := c.read()
	if !ok {
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 1)
	// The database's clock, which stamped created_at, at the reading, plus
	// the time since on this host's monotonic clock: a skewed host clock
	// does not age the events.
	now := b.ReadAt.Add(time.Since(readAt))
	var total int64
	var estimated, attempts int
	for _, s := range b.Shards {
		label := strconv.Itoa(int(s.Shard))
		total += s.Pending
		if !s.Exact {
			estimated++
		}
		attempts = max(attempts, s.MaxAttempts)
		ch <- prometheus.MustNewConstMetric(c.backlog, prometheus.GaugeValue, float64(s.Pending), label)
		if !s.OldestPending.IsZero() {
			ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, max(now.Sub(s.OldestPending), 0).Seconds(), label)
		}
	}
	ch <- prometheus.MustNewConstMetric(c.total, prometheus.GaugeValue, float64(total))
	ch <- prometheus.MustNewConstMetric(c.estimated, prometheus.GaugeValue, float64(estimated))
	ch <- prometheus.MustNewConstMetric(c.dead, prometheus.GaugeValue, float64(b.DeadLetters))
	ch <- prometheus.MustNewConstMetric(c.attempts, prometheus.GaugeValue, float64(attempts))
	ch <- prometheus.MustNewConstMetric(c.unowned, prometheus.GaugeValue, float64(b.UnownedShards))
}

var (
	_ relay.Observer              = (*Observer)(nil)
	_ relay.EventObserver         = (*Observer)(nil)
	_ relay.SickPartitionObserver = (*Observer)(nil)
)
