package relay_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
)

// benchRounds is how many times each contender runs, alternating.
const benchRounds = 3

// benchPool opens a pool of its own (application_name app, up to n
// connections), closed when the benchmark ends.
func benchPool(b *testing.B, app string, n int32) *pgxpool.Pool {
	b.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL(b))
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = n
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool
}

// fillN inserts n events of 256 bytes over 1,000 keys and VACUUM ANALYZEs.
func fillN(b *testing.B, schema, topic string, n int) {
	b.Helper()
	table := pgx.Identifier{schema, "outbox"}.Sanitize()
	_, err := pgtest.Pool(b).Exec(context.Background(), `INSERT INTO `+table+` (topic, key, value)
SELECT $1, ('key-' || (g % 1000))::bytea, convert_to(repeat('x', 256), 'UTF8') FROM generate_series(1, $2) g`, topic, n)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := pgtest.Pool(b).Exec(context.Background(), `VACUUM ANALYZE `+table); err != nil {
		b.Fatal(err)
	}
}

// plainLoop drains schema's outbox with the plain batch loop (the naive
// contender every drain benchmark compares the relay with).
func plainLoop(b *testing.B, cl *kgo.Client, schema string, n int) float64 {
	return plainLoopOn(b, pgtest.Pool(b), cl, schema, n)
}

// plainLoopOn is plainLoop on pool.
func plainLoopOn(b *testing.B, pool *pgxpool.Pool, cl *kgo.Client, schema string, n int) float64 {
	ctx := context.Background()
	table := pgx.Identifier{schema, "outbox"}.Sanitize()
	start := time.Now()
	for {
		rows, _ := pool.Query(ctx, `SELECT id, event_id::text, topic, key, value FROM `+table+` ORDER BY id LIMIT 1000`)
		var ids []int64
		var recs []*kgo.Record
		for rows.Next() {
			var id int64
			r := &kgo.Record{}
			var ev string
			if err := rows.Scan(&id, &ev, &r.Topic, &r.Key, &r.Value); err != nil {
				b.Fatal(err)
			}
			r.Headers = []kgo.RecordHeader{{Key: "message-id", Value: []byte(ev)}}
			ids, recs = append(ids, id), append(recs, r)
		}
		if err := rows.Err(); err != nil {
			b.Fatal(err)
		}
		if len(ids) == 0 {
			break
		}
		if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
			b.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `DELETE FROM `+table+` WHERE id = ANY($1)`, ids); err != nil {
			b.Fatal(err)
		}
	}
	return perSecond(n, time.Since(start))
}

// BenchmarkRelayStuckKey: 300,000 events of one key whose topic refuses
// every write with a retriable error, then 50,000 events of 1,000 other
// keys. Reports how fast the other keys drain beside the same 50,000 events
// without the stuck key: stuckKeyRounds pairs (ONCEFLOW_BENCH_STUCK_ROUNDS),
// the side that goes first alternating, after a drain of each shape that is
// not counted (the process's first drain pays for its Kafka client's and
// pool's first use, and took it from whichever side ran first).
// ONCEFLOW_BENCH_STUCK_OTHERS sets the other keys' events (default 50000);
// ONCEFLOW_BENCH_STUCK_EVERY=n gives the stuck key every n-th of them too.
//
//	go test -run '^$' -bench RelayStuckKey -benchtime 1x ./relay/
func BenchmarkRelayStuckKey(b *testing.B) {
	const stuck = 300_000
	others := 50_000
	if n, err := strconv.Atoi(os.Getenv("ONCEFLOW_BENCH_STUCK_OTHERS")); err == nil && n > 0 {
		others = n
	}
	rounds := stuckKeyRounds
	if n, err := strconv.Atoi(os.Getenv("ONCEFLOW_BENCH_STUCK_ROUNDS")); err == nil && n > 0 {
		rounds = n
	}
	// A key that still gets events while stuck; the drain without it has
	// neither those events nor the stuck key's 300,000.
	every, _ := strconv.Atoi(os.Getenv("ONCEFLOW_BENCH_STUCK_EVERY"))
	for range b.N {
		bu := setupBench(b)
		topic := bu.kafka.Topic(b, 8)
		// drain drains one side and returns the other keys' rate.
		drain := func(withStuck bool, stuck, others int) float64 {
			fillStuckBench(b, bu, topic, withStuck, stuck, others)
			want := others
			if every > 0 {
				want -= stuckAmongOthers(b, bu.schema, topic, withStuck, every)
			}
			drained := &drainObserver{want: int64(want), done: make(chan struct{})}
			pub := &refusingPublisher{Publisher: bu.publisher(b), topic: "stuck"}
			start := time.Now()
			_, stop := bu.startRelayWith(b, bu.pool, pub, relay.Config{Observer: drained})
			select {
			case <-drained.done:
			case <-time.After(10 * time.Minute):
				b.Fatal("the other keys did not drain in 10 minutes")
			}
			rate := perSecond(want, time.Since(start))
			stop()
			pgtest.DropSchema(b, bu.schema)
			return rate
		}
		for _, withStuck := range []bool{true, false} {
			drain(withStuck, stuck/10, others/5) // not counted
		}
		var with, without, ratios []float64
		for round := range rounds {
			rate := map[bool]float64{}
			for _, withStuck := range []bool{round%2 == 0, round%2 == 1} {
				rate[withStuck] = drain(withStuck, stuck, others)
			}
			with, without = append(with, rate[true]), append(without, rate[false])
			ratios = append(ratios, rate[true]/rate[false])
		}
		if every > 0 {
			fmt.Printf("\nthe stuck key also gets every %d-th event among the others", every)
		}
		fmt.Printf("\n%d events of other keys, with and without %d events of a stuck key ahead of them (medians of %d rounds):\n"+
			"  with the stuck key     %8.0f events/s  (runs: %s)\n"+
			"  without                %8.0f events/s  (runs: %s)\n"+
			"  with/without           %8.2fx         (per round: %s)\n",
			others, stuck, rounds, median(with), rates(with, 1), median(without), rates(without, 1), median(ratios), rates(ratios, 100))
		b.ReportMetric(median(ratios), "with/without-stuck")
	}
}

// stuckKeyRounds is BenchmarkRelayStuckKey's default pairs of drains: its
// single rounds swing 0.68-0.95x on one binary.
const stuckKeyRounds = 5

// fillStuckBench makes a fresh schema for bu holding, with withStuck, stuck
// events of the key "stuck" (topic "stuck", the refusingPublisher's) first,
// then others events over 1,000 keys of topic.
//
// It starts with a CHECKPOINT: the fill (the stuck key's 300,000 events
// write ~7 times the others' WAL) otherwise set off checkpoints at
// max_wal_size every other drain, and a drain that began just after one
// wrote a full-page image for every heap page its deletes touched first:
// rounds of one binary swung 0.60-1.04x, more often against the side with
// the stuck key. From a checkpoint, the fill and its drain stay within one
// checkpoint's WAL: neither side pays full pages.
func fillStuckBench(b *testing.B, bu *bundle, topic string, withStuck bool, stuck, others int) {
	b.Helper()
	if _, err := pgtest.Pool(b).Exec(context.Background(), `CHECKPOINT`); err != nil {
		b.Fatal(err)
	}
	bu.schema = pgtest.Schema(b)
	if withStuck {
		table := pgx.Identifier{bu.schema, "outbox"}.Sanitize()
		if _, err := pgtest.Pool(b).Exec(context.Background(), `INSERT INTO `+table+` (topic, key, value)
SELECT 'stuck', 'stuck'::bytea, convert_to(repeat('x', 256), 'UTF8') FROM generate_series(1, $1)`, stuck); err != nil {
			b.Fatal(err)
		}
	}
	fillN(b, bu.schema, topic, others)
}

// stuckAmongOthers gives the stuck key every every-th event of topic (by
// id), or, without withStuck, deletes those, and returns how many.
func stuckAmongOthers(b *testing.B, schema, topic string, withStuck bool, every int) int {
	b.Helper()
	table := pgx.Identifier{schema, "outbox"}.Sanitize()
	sql := `DELETE FROM ` + table + ` WHERE topic = $1 AND id % $2 = 0`
	if withStuck {
		sql = `UPDATE ` + table + ` SET topic = 'stuck', key = 'stuck' WHERE topic = $1 AND id % $2 = 0`
	}
	tag, err := pgtest.Pool(b).Exec(context.Background(), sql, topic, every)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := pgtest.Pool(b).Exec(context.Background(), `VACUUM ANALYZE `+table); err != nil {
		b.Fatal(err)
	}
	return int(tag.RowsAffected())
}

// refusingPublisher fails every record of topic with a retriable error
// (what a partition below min.insync.replicas answers), and publishes the
// rest through Publisher.
type refusingPublisher struct {
	relay.Publisher
	topic string
}

var errNotEnoughReplicas = errors.New("NOT_ENOUGH_REPLICAS (injected)")

func (p *refusingPublisher) Publish(ctx context.Context, records []relay.Record) []error {
	errs := make([]error, len(records))
	var pass []relay.Record
	var at []int
	for i, r := range records {
		if r.Topic == p.topic {
			errs[i] = errNotEnoughReplicas
			continue
		}
		pass, at = append(pass, r), append(at, i)
	}
	if len(pass) > 0 {
		for j, err := range p.Publisher.Publish(ctx, pass) {
			errs[at[j]] = err
		}
	}
	return errs
}

// BenchmarkRelayIdle measures what an idle relay costs: statements per
// second it sends and CPU its PostgreSQL backends use, over 10 s with an
// empty outbox, in its default configuration.
//
//	go test -run '^$' -bench RelayIdle -benchtime 1x ./relay/
func BenchmarkRelayIdle(b *testing.B) {
	ctx := context.Background()
	for range b.N {
		bu := setupBench(b)
		bu.schema = pgtest.Schema(b)
		cfg, err := pgxpool.ParseConfig(pgtest.URL(b))
		if err != nil {
			b.Fatal(err)
		}
		cfg.ConnConfig.RuntimeParams["application_name"] = "idle-" + bu.schema
		counter := &queryCounter{}
		cfg.ConnConfig.Tracer = counter
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			b.Fatal(err)
		}
		defer pool.Close()
		_, stop := bu.startRelayWith(b, pool, bu.publisher(b), relay.Config{PollInterval: 250 * time.Millisecond, LeaseDuration: 6 * time.Second})
		time.Sleep(time.Second)
		const window = 10 * time.Second
		cpu0, q0, t0 := backendCPU(b, "idle-"+bu.schema), counter.n.Load(), time.Now()
		time.Sleep(window)
		cpu1, q1, t1 := backendCPU(b, "idle-"+bu.schema), counter.n.Load(), time.Now()
		stop()
		secs := t1.Sub(t0).Seconds()
		qps, cpu := float64(q1-q0)/secs, 100*(cpu1-cpu0)/secs
		fmt.Printf("\nidle relay (probe 5 ms, poll 250 ms, lease 6 s): %.0f statements/s, PostgreSQL backends %.2f%% of one core\n", qps, cpu)
		b.ReportMetric(qps, "statements/s")
		b.ReportMetric(cpu, "pg-cpu-%")
	}
}

type queryCounter struct{ n atomic.Int64 }

func (c *queryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *queryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// backendCPU returns the CPU seconds used so far by the PostgreSQL
// backends whose application_name is app (read from /proc: the database
// runs on this machine).
func backendCPU(b *testing.B, app string) float64 {
	rows, _ := pgtest.Pool(b).Query(context.Background(), `SELECT pid FROM pg_stat_activity WHERE application_name = $1`, app)
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		b.Fatal(err)
	}
	var ticks float64
	for _, pid := range pids {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// Fields after the command (which may hold spaces): utime is the
		// 14th field, stime the 15th.
		f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+2:]))
		u, _ := strconv.ParseFloat(f[11], 64)
		s, _ := strconv.ParseFloat(f[12], 64)
		ticks += u + s
	}
	return ticks / 100 // USER_HZ
}
