package relayprom_test

import (
	"context"
	"crypto/sha256"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relayprom"
)

// gather returns the gauges of reg by name, each as its label "shard" (""
// without one) to value.
func gather(t *testing.T, reg *prometheus.Registry) map[string]map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]map[string]float64{}
	for _, mf := range mfs {
		out[mf.GetName()] = map[string]float64{}
		for _, m := range mf.GetMetric() {
			out[mf.GetName()][shardLabel(m)] = m.GetGauge().GetValue()
		}
	}
	return out
}

func shardLabel(m *dto.Metric) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == "shard" {
			return l.GetValue()
		}
	}
	return ""
}

func sum(series map[string]float64) (s float64) {
	for _, v := range series {
		s += v
	}
	return s
}

// owner is a relay's changing set of owned shards.
type owner struct{ shards []int16 }

func (o *owner) owned() []int16 { return o.shards }

// Two relays owning disjoint shards report only those: the sum of their
// per-shard backlogs, and of their totals, is the outbox's backlog (not
// twice it), and a shard that changes hands moves to its new owner's
// figures at the next read.
func TestBacklogSumAcrossRelaysIsTheBacklog(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	ctx := context.Background()
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 't', ('k' || g)::bytea, 'v' FROM generate_series(1, 500) g`); err != nil {
		t.Fatal(err)
	}
	every := relay.EveryShard()
	a, b := &owner{every[:128]}, &owner{every[128:]}
	regA, regB := prometheus.NewPedanticRegistry(), prometheus.NewPedanticRegistry()
	regA.MustRegister(relayprom.NewBacklogCollector(pool, schema, &relayprom.CollectorConfig{Owned: a.owned, MinInterval: time.Nanosecond}))
	regB.MustRegister(relayprom.NewBacklogCollector(pool, schema, &relayprom.CollectorConfig{Owned: b.owned, MinInterval: time.Nanosecond}))

	check := func(wantA, wantB int) {
		t.Helper()
		ma, mb := gather(t, regA), gather(t, regB)
		if n := len(ma["onceflow_outbox_backlog"]); n != wantA {
			t.Errorf("relay A reports %d shards, want the %d it owns", n, wantA)
		}
		if n := len(mb["onceflow_outbox_backlog"]); n != wantB {
			t.Errorf("relay B reports %d shards, want the %d it owns", n, wantB)
		}
		for sh := range ma["onceflow_outbox_backlog"] {
			if _, both := mb["onceflow_outbox_backlog"][sh]; both {
				t.Errorf("shard %s reported by both relays", sh)
			}
		}
		if got := sum(ma["onceflow_outbox_backlog"]) + sum(mb["onceflow_outbox_backlog"]); got != 500 {
			t.Errorf("sum of onceflow_outbox_backlog across relays = %v, want 500", got)
		}
		if got := sum(ma["onceflow_outbox_backlog_events"]) + sum(mb["onceflow_outbox_backlog_events"]); got != 500 {
			t.Errorf("sum of onceflow_outbox_backlog_events across relays = %v, want 500", got)
		}
		if got := sum(ma["onceflow_outbox_backlog_estimated_shards"]) + sum(mb["onceflow_outbox_backlog_estimated_shards"]); got != 0 {
			t.Errorf("%v shards estimated, want every small shard counted exactly", got)
		}
	}
	check(128, 128)

	// (500 keys, about 2 events a shard: every figure is exact.)
	// Shards 0-63 move from A to B.
	a.shards, b.shards = every[64:128], append(append([]int16{}, every[:64]...), every[128:]...)
	check(64, 192)

	// A relay that owns nothing reports no backlog.
	a.shards, b.shards = nil, every
	check(0, 256)
	if got := gather(t, regA)["onceflow_outbox_backlog_events"][""]; got != 0 {
		t.Errorf("a relay owning nothing reports a backlog of %v", got)
	}
}

// A shard holding many events is counted from a few index probes and
// labelled an estimate (onceflow_outbox_backlog_estimated_shards); small
// shards stay exact; the oldest-pending age and the highest attempt count
// come from the head of each shard.
func TestLargeShardBacklogIsAnEstimateAndSaysSo(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	ctx := context.Background()
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	// 20,000 events of one key (its stuck head has 9 attempts and is an
	// hour old), then 200 over other keys.
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value, attempts, created_at)
SELECT 't', 'hot'::bytea, 'v', CASE WHEN g = 1 THEN 9 ELSE 0 END, now() - CASE WHEN g = 1 THEN interval '1 hour' ELSE interval '0' END
FROM generate_series(1, 20000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 't', ('k' || g)::bytea, 'v' FROM generate_series(1, 200) g`); err != nil {
		t.Fatal(err)
	}
	hot := int16(sha256.Sum256([]byte("hot"))[0])
	var exact int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+outbox+` WHERE shard = $1`, hot).Scan(&exact); err != nil {
		t.Fatal(err)
	}

	b, err := relay.ReadBacklog(ctx, pool, schema, relay.EveryShard())
	if err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, s := range b.Shards {
		total += s.Pending
		if s.Shard == hot {
			if s.Exact {
				t.Errorf("shard %d (%d events) reported exact", s.Shard, exact)
			}
			if s.Pending < exact*9/10 || s.Pending > exact*11/10 {
				t.Errorf("shard %d: estimate %d, want within 10%% of %d", s.Shard, s.Pending, exact)
			}
			if s.MaxAttempts != 9 {
				t.Errorf("shard %d: max attempts %d, want the head's 9", s.Shard, s.MaxAttempts)
			}
			if age := time.Since(s.OldestPending); age < 59*time.Minute {
				t.Errorf("shard %d: oldest pending %v old, want the head's hour", s.Shard, age)
			}
			continue
		}
		var n int64
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+outbox+` WHERE shard = $1`, s.Shard).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if !s.Exact || s.Pending != n {
			t.Errorf("shard %d: %d (exact %v), want exactly %d", s.Shard, s.Pending, s.Exact, n)
		}
	}

	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(relayprom.NewBacklogCollector(pool, schema, nil))
	m := gather(t, reg)
	if got := m["onceflow_outbox_backlog_estimated_shards"][""]; got != 1 {
		t.Errorf("onceflow_outbox_backlog_estimated_shards = %v, want 1", got)
	}
	if got := m["onceflow_outbox_max_attempts"][""]; got != 9 {
		t.Errorf("onceflow_outbox_max_attempts = %v, want 9", got)
	}
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == "onceflow_outbox_backlog" && !strings.Contains(mf.GetHelp(), "estimated") {
			t.Errorf("onceflow_outbox_backlog's help does not say when it is estimated: %q", mf.GetHelp())
		}
	}
}

// Scrapes closer together than MinInterval report the last reading, so a
// fast scrape interval does not read the database more often.
func TestScrapesWithinMinIntervalReadOnce(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	ctx := context.Background()
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	insert := func() {
		t.Helper()
		if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value) VALUES ('t', 'k', 'v')`); err != nil {
			t.Fatal(err)
		}
	}
	insert()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(relayprom.NewBacklogCollector(pool, schema, &relayprom.CollectorConfig{MinInterval: time.Hour}))
	if got := gather(t, reg)["onceflow_outbox_backlog_events"][""]; got != 1 {
		t.Fatalf("backlog %v, want 1", got)
	}
	insert()
	if got := gather(t, reg)["onceflow_outbox_backlog_events"][""]; got != 1 {
		t.Errorf("a scrape within MinInterval read again: backlog %v, want the last reading's 1", got)
	}

	reg = prometheus.NewPedanticRegistry()
	reg.MustRegister(relayprom.NewBacklogCollector(pool, schema, &relayprom.CollectorConfig{MinInterval: 10 * time.Millisecond}))
	_ = gather(t, reg)
	insert()
	deadline := time.Now().Add(30 * time.Second)
	for gather(t, reg)["onceflow_outbox_backlog_events"][""] != 3 {
		if time.Now().After(deadline) {
			t.Fatal("a scrape after MinInterval did not read again")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A backlog read that fails says why in the log, once for each new error
// and again when reads succeed: onceflow_outbox_scrape_ok went to 0 with
// nothing logged at any level, so an operator could not tell a missing
// grant (SELECT on outbox_dead, which only the metrics read) from a
// database down (helper 76).
func TestAFailedBacklogReadIsLoggedOnce(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	ctx := context.Background()
	var logs strings.Builder
	log := slog.New(slog.NewTextHandler(&logs, nil))
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(relayprom.NewBacklogCollector(pool, schema, &relayprom.CollectorConfig{MinInterval: time.Nanosecond, Logger: log}))
	dead := pgx.Identifier{schema, "outbox_dead"}.Sanitize()
	if _, err := pool.Exec(ctx, `ALTER TABLE `+dead+` RENAME TO outbox_dead_away`); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if got := gather(t, reg)["onceflow_outbox_scrape_ok"][""]; got != 0 {
			t.Fatalf("scrape_ok %v with outbox_dead gone", got)
		}
	}
	if n := strings.Count(logs.String(), "level=WARN msg=\"relayprom: the backlog could not be read"); n != 1 || !strings.Contains(logs.String(), "outbox_dead") {
		t.Fatalf("%d warnings for three failed reads of the same error, want one naming it:\n%s", n, logs.String())
	}
	if _, err := pool.Exec(ctx, `ALTER TABLE `+pgx.Identifier{schema, "outbox_dead_away"}.Sanitize()+` RENAME TO outbox_dead`); err != nil {
		t.Fatal(err)
	}
	if got := gather(t, reg)["onceflow_outbox_scrape_ok"][""]; got != 1 {
		t.Fatalf("scrape_ok %v once outbox_dead is back", got)
	}
	if !strings.Contains(logs.String(), "level=INFO msg=\"relayprom: the backlog is read again\"") {
		t.Fatalf("no word of the recovery:\n%s", logs.String())
	}
}

// The oldest pending event's age is measured on the database's clock,
// which stamped created_at, not on the scraping host's: a relay host whose
// clock ran ahead reported events that old, and OnceflowOutboxBacklogOld
// fired on a backlog of fresh events (helper 86). Here the database's clock
// is a transaction's: now() stays at the transaction's start while the host's
// clock moves on 1.5 s.
func TestOldestPendingAgeIsOnTheDatabasesClock(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	ctx := context.Background()
	tx, err := pgtest.Pool(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	if _, err := tx.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "outbox"}.Sanitize()+` (topic, key, value) VALUES ('t', 'k', 'v')`); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(relayprom.NewBacklogCollector(tx, schema, &relayprom.CollectorConfig{MinInterval: time.Hour}))
	ages := gather(t, reg)["onceflow_outbox_oldest_pending_age_seconds"]
	if len(ages) != 1 {
		t.Fatalf("%d shards with an oldest pending age, want 1: %v", len(ages), ages)
	}
	for shard, age := range ages {
		if age > 1 {
			t.Errorf("shard %s: oldest pending age %.3fs, want under 1s: the event is as old as the database's clock says (0s), whatever the host's says", shard, age)
		}
	}
	// A cached reading ages by the time since it was read, on the host's
	// monotonic clock.
	time.Sleep(1100 * time.Millisecond)
	for shard, age := range gather(t, reg)["onceflow_outbox_oldest_pending_age_seconds"] {
		if age < 1 || age > 3 {
			t.Errorf("shard %s: a cached reading 1.1s later reports age %.3fs, want about 1.1s", shard, age)
		}
	}
}
