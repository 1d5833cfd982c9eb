package relay

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// partitionedOutboxDDL replaces a migrated schema's outbox with one
// partitioned by shard range: 16 partitions of 16 shards (outbox_p0 …
// outbox_p15). PostgreSQL refuses a generated column as a partition key
// ("cannot use generated column in partition key"), so the key is the
// shard column's expression; a primary key must hold every partition-key
// column and cannot hold an expression, so id has a plain index per
// partition and no uniqueness. The other columns, the identity and the
// generated shard are today's; the producers' INSERT is unchanged.
const partitionedOutboxDDL = `DROP TABLE outbox;
CREATE TABLE outbox (
    id          bigint GENERATED ALWAYS AS IDENTITY,
    event_id    uuid        NOT NULL DEFAULT gen_random_uuid(),
    topic       text        NOT NULL CHECK (topic <> '' AND length(topic) <= 249),
    key         bytea,
    value       bytea,
    headers     jsonb CHECK (headers IS NULL OR (jsonb_typeof(headers) = 'object'
                     AND NOT jsonb_path_exists(headers, '$.* ? (@.type() != "string")'))),
    created_at  timestamptz NOT NULL DEFAULT now(),
    shard       smallint    NOT NULL GENERATED ALWAYS AS
                    (get_byte(sha256(coalesce(key, uuid_send(event_id))), 0)) STORED,
    attempts    integer     NOT NULL DEFAULT 0,
    last_error  text,
    first_refused_at timestamptz,
    refused_kind smallint
) PARTITION BY RANGE ((get_byte(sha256(coalesce(key, uuid_send(event_id))), 0)));
DO $$ BEGIN FOR i IN 0..15 LOOP
    EXECUTE format('CREATE TABLE outbox_p%s PARTITION OF outbox FOR VALUES FROM (%s) TO (%s)', i, i*16, i*16+16);
END LOOP; END $$;
CREATE INDEX outbox_id_idx ON outbox (id);
CREATE INDEX outbox_shard_id_idx ON outbox (shard, id);
CREATE INDEX outbox_key_hash_idx ON outbox ((substring(sha256(coalesce(key, uuid_send(event_id))) FROM 1 FOR 8)), id);`

// BenchmarkPartitionedOutboxDB weighs partitioning the outbox by shard
// range (issue 10) on the database side of a drain, without Kafka: each
// worker (one connection) claims 1,000 events of its shards, reads them,
// and deletes them by id, until the outbox is empty; CPU per event is its
// PostgreSQL backends' (utime+stime). Contenders, alternating, each on a
// fresh schema of ONCEFLOW_BENCH_PARTITION events (256-byte values over
// 1,000 keys):
//
//   - pk x1: today's table, one worker owning every shard, reading the
//     primary key in id order (the relay's claimAllQuery);
//   - merge x4: today's table, four workers of 64 consecutive shards
//     each, reading claimShardsQuery's merge of one index range per shard;
//   - part x4: the partitioned table (partitionedOutboxDDL), four workers
//     each owning four whole partitions, reading them by name, each in id
//     order, merged, and deleting from each partition by name;
//   - part x1: the partitioned table, one worker reading all 16 so.
//
// It runs only with ONCEFLOW_BENCH_PARTITION set (the number of events,
// e.g. 300000; ONCEFLOW_BENCH_ROUNDS rounds, default 3): the partitioned
// table is an experiment, not a schema the relay supports.
//
//	ONCEFLOW_BENCH_PARTITION=300000 go test -run '^$' -bench PartitionedOutboxDB -benchtime 1x ./relay/
func BenchmarkPartitionedOutboxDB(b *testing.B) {
	n, _ := strconv.Atoi(os.Getenv("ONCEFLOW_BENCH_PARTITION"))
	if n <= 0 {
		b.Skip("ONCEFLOW_BENCH_PARTITION (events to drain) not set: an experiment on a schema the relay does not support")
	}
	rounds := 3
	if r, err := strconv.Atoi(os.Getenv("ONCEFLOW_BENCH_ROUNDS")); err == nil && r > 0 {
		rounds = r
	}
	type contender struct {
		name        string
		partitioned bool
		workers     int
	}
	cs := []contender{{"pk x1", false, 1}, {"merge x4", false, 4}, {"part x4", true, 4}, {"part x1", true, 1}}
	for range b.N {
		res := map[string][][2]float64{}
		for round := range rounds {
			for i := range cs {
				c := cs[(i+round)%len(cs)]
				rate, cpu, held := partitionDrain(b, c.partitioned, c.workers, n)
				res[c.name] = append(res[c.name], [2]float64{rate, cpu})
				fmt.Printf("  [round %d] %-8s %8.0f events/s  postgres cpu %.2f µs/event", round+1, c.name, rate, cpu)
				if held >= 1 {
					fmt.Printf("  (another transaction held the xmin horizon for %.0f s)", held)
				}
				fmt.Println()
			}
		}
		load, _ := os.ReadFile("/proc/loadavg")
		fmt.Printf("\nclaim and delete %d events, database side only (medians of %d rounds; load average %s):\n", n, rounds, strings.Join(strings.Fields(string(load))[:3], " "))
		med := map[string][2]float64{}
		for _, c := range cs {
			var rs, cpus []float64
			for _, r := range res[c.name] {
				rs, cpus = append(rs, r[0]), append(cpus, r[1])
			}
			med[c.name] = [2]float64{partMedian(rs), partMedian(cpus)}
			fmt.Printf("  %-8s %8.0f events/s  postgres cpu %.2f µs/event\n", c.name, med[c.name][0], med[c.name][1])
		}
		for _, r := range [][2]string{{"merge x4", "pk x1"}, {"part x4", "pk x1"}, {"part x4", "part x1"}, {"part x1", "pk x1"}} {
			fmt.Printf("  %-8s / %-8s rate %.2fx  cpu per event %.2fx\n", r[0], r[1], med[r[0]][0]/med[r[1]][0], med[r[0]][1]/med[r[1]][1])
		}
	}
}

func partMedian(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// partitionDrain fills a fresh schema (partitioned or not) with n events
// and drains it with workers connections, each owning an equal run of
// consecutive shards; it returns the rate, the backends' CPU per event in
// µs, and the longest another session held the xmin horizon meanwhile.
func partitionDrain(b *testing.B, partitioned bool, workers, n int) (rate, cpuPerEvent, held float64) {
	ctx := context.Background()
	pool := pgtest.Pool(b)
	schema := pgtest.Schema(b)
	defer pgtest.DropSchema(b, schema)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	if partitioned {
		if _, err := pool.Exec(ctx, `SET search_path TO `+pgx.Identifier{schema}.Sanitize()+`; `+partitionedOutboxDDL+`; RESET search_path`); err != nil {
			b.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 'bench', ('key-' || (g % 1000))::bytea, convert_to(repeat('x', 256), 'UTF8') FROM generate_series(1, $1) g`, n); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+outbox); err != nil {
		b.Fatal(err)
	}
	conns := make([]*pgx.Conn, workers)
	pids := make([]int, workers)
	for i := range conns {
		cfg, err := pgx.ParseConfig(pgtest.URL(b))
		if err != nil {
			b.Fatal(err)
		}
		cfg.RuntimeParams["application_name"] = "partbench-" + schema
		c, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			b.Fatal(err)
		}
		defer c.Close(ctx)
		conns[i] = c
		if err := c.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pids[i]); err != nil {
			b.Fatal(err)
		}
	}
	partition := func(p int) string { return pgx.Identifier{schema, "outbox_p" + strconv.Itoa(p)}.Sanitize() }
	per := NumShards / workers
	claimSQL := func(w int) string {
		lo, hi := w*per, (w+1)*per
		switch {
		case !partitioned && workers == 1:
			return claimAllQuery(outbox, false, false, false, 1000)
		case !partitioned:
			var shards []int16
			for sh := lo; sh < hi; sh++ {
				shards = append(shards, int16(sh))
			}
			return claimShardsQuery(outbox, shards, 3048, 1000)
		}
		var q strings.Builder
		q.WriteString(`SELECT * FROM (SELECT * FROM (`)
		for p := lo / 16; p < hi/16; p++ {
			if p > lo/16 {
				q.WriteString(` UNION ALL `)
			}
			fmt.Fprintf(&q, `(SELECT `+claimColumns+` FROM %s o ORDER BY o.id LIMIT 3048)`, partition(p))
		}
		q.WriteString(`) AS m ORDER BY m.id LIMIT 3048) AS m WHERE m.id NOT IN (SELECT unnest($1::bigint[])) ORDER BY m.id LIMIT 1000`)
		return q.String()
	}
	stop := watchXmin(b)
	cpu0 := partCPU(pids)
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, q := conns[w], claimSQL(w)
			args := []any{[]int64{}} // $1: the excluded ids
			if !partitioned && workers > 1 {
				args = append(args, make([]int64, per)) // $2: each range from its left edge
			}
			for {
				rows, _ := c.Query(ctx, q, args...)
				events, err := scanEvents(rows, nil)
				if err != nil {
					errs <- err
					return
				}
				if len(events) == 0 {
					return
				}
				ids := make([]int64, len(events))
				byPart := map[int][]int64{}
				for i := range events {
					ids[i] = events[i].id
					p := int(eventHash(&events[i])[0]) / 16
					byPart[p] = append(byPart[p], events[i].id)
				}
				if !partitioned {
					_, err = c.Exec(ctx, `DELETE FROM `+outbox+` o WHERE o.id = ANY($1::bigint[])`, ids)
				} else {
					bt := &pgx.Batch{}
					for p := range NumShards / 16 {
						if len(byPart[p]) > 0 {
							bt.Queue(`DELETE FROM `+partition(p)+` o WHERE o.id = ANY($1::bigint[])`, byPart[p])
						}
					}
					err = c.SendBatch(ctx, bt).Close()
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	cpu := partCPU(pids) - cpu0
	held = stop()
	close(errs)
	for err := range errs {
		b.Fatal(err)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+outbox).Scan(&left); err != nil || left != 0 {
		b.Fatalf("%d events left in the outbox (%v)", left, err)
	}
	return float64(n) / elapsed.Seconds(), 1e6 * cpu / float64(n), held
}

// partCPU returns the CPU seconds (user and system) the processes used.
func partCPU(pids []int) float64 {
	var s float64
	for _, pid := range pids {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+2:]))
		u, _ := strconv.ParseFloat(f[11], 64)
		st, _ := strconv.ParseFloat(f[12], 64)
		s += (u + st) / 100 // USER_HZ
	}
	return s
}

// watchXmin samples every 200 ms how long another client session's
// snapshot has held the xmin horizon, and returns the longest seen (in
// seconds) when the returned function is called (see the drain benchmark's
// watchHorizon).
func watchXmin(b *testing.B) func() float64 {
	ctx, cancel := context.WithCancel(context.Background())
	var longest float64
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(200 * time.Millisecond)
		defer t.Stop()
		for {
			var age float64
			if err := pgtest.Pool(b).QueryRow(ctx, `SELECT coalesce(extract(epoch FROM max(now() - xact_start)), 0)::float8
FROM pg_stat_activity WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
    AND backend_type = 'client backend' AND application_name NOT LIKE 'partbench-%'`).Scan(&age); err == nil {
				longest = max(longest, age)
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return func() float64 {
		cancel()
		<-done
		return longest
	}
}
