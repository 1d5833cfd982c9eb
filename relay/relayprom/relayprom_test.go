package relayprom_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relayprom"
)

// The scrape-time collector reports the backlog in all and per shard, the
// highest attempt count, dead letters and shards without an owner; every
// relay metric passes promlint. Without Owned it reports every shard.
func TestMetricsReadTheOutboxAndPassPromlint(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	ctx := context.Background()
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value, attempts, created_at)
		VALUES ('t', 'a', 'v', 0, now() - interval '1 minute'), ('t', 'a', 'v', 7, now()), ('t', 'b', 'v', 3, now())`); err != nil {
		t.Fatal(err)
	}

	reg := prometheus.NewPedanticRegistry()
	obs := relayprom.NewObserver(reg)
	reg.MustRegister(relayprom.NewBacklogCollector(pool, schema, nil))
	obs.ObserveShards(3)
	obs.ObserveBatch(relay.BatchStats{Published: 2, Duration: time.Millisecond, OldestCreatedAt: time.Now()})
	obs.SickPartitionsChanged(+1)
	obs.ObserveBatch(relay.BatchStats{Failed: 4, HeldBack: 4, SickPartitions: 1, SickPartitionsReported: true, Duration: time.Millisecond})
	// A round's outcome recorded after the next round changed the count
	// carries an older one: the gauge keeps the reported changes.
	obs.SickPartitionsChanged(-1)
	obs.SickPartitionsChanged(+1)
	obs.ObserveBatch(relay.BatchStats{SickPartitions: 0, SickPartitionsReported: true, Duration: time.Millisecond})

	want := `
# HELP onceflow_outbox_backlog_estimated_shards Shards this relay owns whose onceflow_outbox_backlog is an estimate.
# TYPE onceflow_outbox_backlog_estimated_shards gauge
onceflow_outbox_backlog_estimated_shards 0
# HELP onceflow_outbox_backlog_events Pending events in the shards this relay owns (sum across relays); estimated in part when onceflow_outbox_backlog_estimated_shards > 0.
# TYPE onceflow_outbox_backlog_events gauge
onceflow_outbox_backlog_events 3
# HELP onceflow_outbox_dead_events Events in outbox_dead (every relay reports it); PostgreSQL's estimate from 10000 on.
# TYPE onceflow_outbox_dead_events gauge
onceflow_outbox_dead_events 0
# HELP onceflow_outbox_max_attempts Highest publish attempt count among the first pending events of the shards this relay owns: an event stuck on a failure keeps raising it.
# TYPE onceflow_outbox_max_attempts gauge
onceflow_outbox_max_attempts 7
# HELP onceflow_outbox_scrape_ok 1 if the backlog could be read from the database.
# TYPE onceflow_outbox_scrape_ok gauge
onceflow_outbox_scrape_ok 1
# HELP onceflow_outbox_unowned_shards Shards no live relay holds a lease on (every relay reports it).
# TYPE onceflow_outbox_unowned_shards gauge
onceflow_outbox_unowned_shards 256
# HELP onceflow_relay_owned_shards Shards this relay owns.
# TYPE onceflow_relay_owned_shards gauge
onceflow_relay_owned_shards 3
# HELP onceflow_relay_published_total Events acknowledged by Kafka and removed from the outbox.
# TYPE onceflow_relay_published_total counter
onceflow_relay_published_total 2
# HELP onceflow_relay_sick_partition_held_back_total Events not sent in a round because their key's partition is marked sick (also counted in failures); one probe retries the partition.
# TYPE onceflow_relay_sick_partition_held_back_total counter
onceflow_relay_sick_partition_held_back_total 4
# HELP onceflow_relay_sick_partitions Partitions marked sick: a record sent there was not acknowledged (in time, or with a passing error) and none since (summed over the relays reporting to this Observer).
# TYPE onceflow_relay_sick_partitions gauge
onceflow_relay_sick_partitions 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"onceflow_outbox_backlog_events", "onceflow_outbox_backlog_estimated_shards", "onceflow_outbox_dead_events", "onceflow_outbox_max_attempts",
		"onceflow_outbox_scrape_ok", "onceflow_outbox_unowned_shards", "onceflow_relay_owned_shards",
		"onceflow_relay_published_total", "onceflow_relay_sick_partition_held_back_total", "onceflow_relay_sick_partitions"); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(reg, "onceflow_outbox_backlog"); n != relay.NumShards {
		t.Errorf("backlog series = %d, want one per shard (a collector without Owned reports every shard)", n)
	}
	if n := testutil.CollectAndCount(reg, "onceflow_outbox_oldest_pending_age_seconds"); n != 2 {
		t.Errorf("age series = %d, want one per shard holding events (keys a and b)", n)
	}
	problems, err := testutil.GatherAndLint(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("promlint: %s: %s", p.Metric, p.Text)
	}
}

// helper 115: onceflow_relay_oldest_published_age_seconds subtracts the
// event's created_at (the database's clock) from the relay host's clock.
// With the database's clock ahead, the observation was negative and the
// histogram's _sum went down, which no Prometheus histogram may do
// (rate() of it reads as a counter reset). It is clamped at 0, as
// onceflow_outbox_dwell_seconds is.
func TestOldestPublishedAgeIsNeverNegative(t *testing.T) {
	reg := prometheus.NewRegistry()
	o := relayprom.NewObserver(reg)
	o.ObserveBatch(relay.BatchStats{Published: 1, OldestCreatedAt: time.Now().Add(time.Second)}) // the database's clock a second ahead
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "onceflow_relay_oldest_published_age_seconds" {
			h := mf.GetMetric()[0].GetHistogram()
			if h.GetSampleCount() != 1 || h.GetSampleSum() < 0 {
				t.Fatalf("oldest published age: %d observations summing to %g s, want one of at least 0", h.GetSampleCount(), h.GetSampleSum())
			}
			return
		}
	}
	t.Fatal("onceflow_relay_oldest_published_age_seconds not registered")
}
