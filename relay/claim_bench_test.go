package relay

import (
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// BenchmarkClaimAt1M times real claims (median of 21, after 5 warm-ups so
// PostgreSQL uses its generic plan) on a 1M-row backlog, 300,000 of one key
// then 700,000 over 1,000 keys, beside the claim this relay used before
// (one scan of the primary key in id order, filtering shards and blocked
// keys row by row), run alternately on the same data.
//
//	go test -run '^$' -bench ClaimAt1M -benchtime 1x ./relay/
func BenchmarkClaimAt1M(b *testing.B) {
	ctx := context.Background()
	for range b.N {
		schema := pgtest.Schema(b)
		pool := pgtest.Pool(b)
		outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
		if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 'bench', CASE WHEN g <= 300000 THEN 'stuck' ELSE 'key-' || (g % 1000) END::bytea, convert_to(repeat('x', 256), 'UTF8')
FROM generate_series(1, 1000000) g`); err != nil {
			b.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+outbox); err != nil {
			b.Fatal(err)
		}
		var firstID int64
		if err := pool.QueryRow(ctx, `SELECT min(id) FROM `+outbox).Scan(&firstID); err != nil {
			b.Fatal(err)
		}
		stuckShard := int16(sha256.Sum256([]byte("stuck"))[0])
		var quarter []int16
		for sh := int16(0); sh < NumShards && len(quarter) < NumShards/4; sh++ {
			if sh != stuckShard {
				quarter = append(quarter, sh)
			}
		}
		withStuck := append(slices.Clone(quarter[1:]), stuckShard)
		slices.Sort(withStuck)
		stuck := []keyBlock{{key: []byte("stuck"), firstID: firstID}}
		st := newStore(pool, schema)
		st.maxBytes = 16 << 20
		old := oldClaimSQL(outbox)
		fmt.Printf("\nclaim of 1,000 events on a 1M backlog (300k of one key first), median of 21 (ms):\n")
		fmt.Printf("  %-58s %8s %8s  %s\n", "case", "new", "before", "buffers per statement (new)")
		for _, c := range []struct {
			name    string
			shards  []int16
			blocked []keyBlock
		}{
			{"one relay, every shard", everyShard(), nil},
			{"a quarter of the shards, the stuck key's elsewhere", quarter, nil},
			{"every shard, the stuck key blocked", everyShard(), stuck},
			{"a quarter with the stuck key's, the key blocked", withStuck, stuck},
		} {
			notOwned := make([]int16, 0, NumShards)
			for sh := int16(0); sh < NumShards; sh++ {
				if _, found := slices.BinarySearch(c.shards, sh); !found {
					notOwned = append(notOwned, sh)
				}
			}
			keys, firsts := [][]byte{}, []int64{}
			for _, k := range c.blocked {
				keys, firsts = append(keys, k.key), append(firsts, k.firstID)
			}
			var newTimes, oldTimes []float64
			for i := range 26 {
				start := time.Now()
				events, err := st.claim(ctx, "bench", c.shards, 1000, c.blocked, nil)
				if err != nil {
					b.Fatal(err)
				}
				if i >= 5 {
					newTimes = append(newTimes, float64(time.Since(start).Microseconds())/1000)
				}
				if len(events) == 0 {
					b.Fatalf("%s: claimed nothing", c.name)
				}
				start = time.Now()
				rows, _ := pool.Query(ctx, old, notOwned, 1000, []int64{}, keys, firsts)
				rows.Close()
				if err := rows.Err(); err != nil {
					b.Fatal(err)
				}
				if i >= 5 {
					oldTimes = append(oldTimes, float64(time.Since(start).Microseconds())/1000)
				}
			}
			slices.Sort(newTimes)
			slices.Sort(oldTimes)
			var buffers []string
			for _, stmt := range st.claimStatements(c.shards, 1000, c.blocked, nil) {
				buffers = append(buffers, fmt.Sprint(topBuffers(explainGeneric(b, stmt))))
			}
			fmt.Printf("  %-58s %8.2f %8.2f  %s\n", c.name, newTimes[len(newTimes)/2], oldTimes[len(oldTimes)/2], strings.Join(buffers, " + "))
			if len(c.blocked) > 0 {
				blockedShardReads(b, st, c.shards, c.blocked)
			}
		}
	}
}

// oldClaimSQL is the claim before per-shard reads: the primary key in id
// order, shards and blocked keys filtered row by row.
func oldClaimSQL(outbox string) string {
	return `SELECT o.id, o.event_id, o.topic, o.key, o.value, o.headers, o.created_at,
       extract(epoch FROM now() - o.first_refused_at)::float8 AS refused_for
FROM ` + outbox + ` o
WHERE o.shard NOT IN (SELECT unnest($1::smallint[]))
  AND NOT EXISTS (SELECT 1 FROM unnest($4::bytea[], $5::bigint[]) AS b(k, first_id)
                  WHERE o.key = b.k AND o.id >= b.first_id)
  AND o.id NOT IN (SELECT unnest($3::bigint[]))
ORDER BY o.id
LIMIT $2`
}

// blockedShardReads times the read of the shards holding blocked keys alone
// (median of 21, alternating): by key hash as far as the round needs, as
// claim does, and read whole and sorted by id, as it did before (the same
// key-hash ranges without limits), and prints both with their buffers. It
// is the read beside the free shards' shares (floorOff set, which
// claimStatements counts down): beside a floor read it reads only below the
// floor's base (mergeBlocked), on this data nothing.
func blockedShardReads(b *testing.B, st *store, shards []int16, blocked []keyBlock) {
	ctx := context.Background()
	floorOff := st.floorOff
	st.floorOff = 2
	stmts := st.claimStatements(shards, 1000, blocked, nil)
	st.floorOff = floorOff
	sweep := stmts[len(stmts)-1]
	segs := blockedSegments(blocked)
	var parts []string
	for _, sh := range shards {
		for _, g := range segs[sh] {
			if g.eq != nil {
				parts = append(parts, fmt.Sprintf(`SELECT `+claimColumns+` FROM %s o WHERE `+keyHashSQL+` = '\x%x'::bytea AND o.id < %d`, st.outbox, g.eq, g.before))
			} else {
				parts = append(parts, fmt.Sprintf(`SELECT `+claimColumns+` FROM %s o WHERE `+keyHashSQL+` >= '\x%x'::bytea AND `+keyHashSQL+` < '\x%x'::bytea`, st.outbox, g.lo, g.hi))
			}
		}
	}
	sorted := boundBytes(statement{sql: `SELECT * FROM (` + strings.Join(parts, "\nUNION ALL ") + `) AS m
WHERE m.id NOT IN (SELECT unnest($1::bigint[])) ORDER BY m.id LIMIT 1000`, args: []any{[]int64{}}}, st.maxBytes)
	run := func(stmt statement) float64 {
		batch := &pgx.Batch{}
		if stmt.noBitmap {
			batch.Queue(`SELECT set_config('enable_bitmapscan', 'off', true)`)
		}
		var n int
		batch.Queue(stmt.sql, stmt.args...).Query(func(rows pgx.Rows) error {
			for rows.Next() {
				n++
			}
			return rows.Err()
		})
		start := time.Now()
		if err := st.pool.SendBatch(ctx, batch).Close(); err != nil {
			b.Fatal(err)
		}
		if n == 0 {
			b.Fatal("the blocked shards' read returned nothing")
		}
		return float64(time.Since(start).Microseconds()) / 1000
	}
	var sweepTimes, sortedTimes []float64
	for i := range 26 {
		a, o := run(sweep), run(sorted)
		if i >= 5 {
			sweepTimes, sortedTimes = append(sweepTimes, a), append(sortedTimes, o)
		}
	}
	slices.Sort(sweepTimes)
	slices.Sort(sortedTimes)
	fmt.Printf("      its blocked shard's read: by key hash %.2f ms (%d buffers), whole and sorted %.2f ms (%d buffers)\n",
		sweepTimes[len(sweepTimes)/2], topBuffers(explainGeneric(b, sweep)), sortedTimes[len(sortedTimes)/2], topBuffers(explainGeneric(b, sorted)))
}

// BenchmarkClaimBesideAStuckKey times the claims of a drain beside a stuck
// key (BenchmarkRelayStuckKey's data: 300,000 events of one key, blocked,
// then 50,000 of 1,000 other keys, 256-byte values), each round claimed
// and deleted at once, with and without floor proofs (claimproof.go;
// without is the claim before them: every floor read descends every free
// shard), on two copies of the data, claim for claim in turn. It prints,
// per pass, the median of the floor reads' claim times, how many floor
// reads had a proof, and the proof's own steps beside.
//
// ONCEFLOW_BENCH_STUCK_OTHERS sets the other keys' events (default 50000).
//
//	go test -run '^$' -bench ClaimBesideAStuckKey -benchtime 1x ./relay/
func BenchmarkClaimBesideAStuckKey(b *testing.B) {
	ctx := context.Background()
	pool := pgtest.Pool(b)
	others := 50_000
	if n, err := strconv.Atoi(os.Getenv("ONCEFLOW_BENCH_STUCK_OTHERS")); err == nil && n > 0 {
		others = n
	}
	for range b.N {
		fmt.Printf("\nfloor claims of 1,000 beside a stuck key of 300,000 (%d others), median per pass (ms):\n", others)
		for pass := range 3 {
			type side struct {
				st     *store
				schema string
				outbox string
				times  []float64
				proved int
			}
			var sides [2]*side // 0: every descent, 1: with proofs
			for i := range sides {
				schema := pgtest.Schema(b)
				outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
				if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 'bench', CASE WHEN g <= 300000 THEN 'stuck' ELSE 'key-' || (g % 1000) END::bytea, convert_to(repeat('x', 256), 'UTF8')
FROM generate_series(1, 300000 + $1) g`, others); err != nil {
					b.Fatal(err)
				}
				st := newStore(pool, schema)
				st.maxBytes = 16 << 20
				if i == 0 {
					st.seqChecked = true // no sequence known: no proof
				}
				sides[i] = &side{st: st, schema: schema, outbox: outbox}
			}
			var firstID [2]int64
			for i, s := range sides {
				if err := pool.QueryRow(ctx, `SELECT min(id) FROM `+s.outbox).Scan(&firstID[i]); err != nil {
					b.Fatal(err)
				}
			}
			for done := 0; done < 2; {
				done = 0
				for i, s := range sides {
					proved := s.st.proof.below > 0
					start := time.Now()
					events, err := s.st.claim(ctx, "bench", everyShard(), 1000, []keyBlock{{key: []byte("stuck"), firstID: firstID[i]}}, nil)
					if err != nil {
						b.Fatal(err)
					}
					took := float64(time.Since(start).Microseconds()) / 1000
					if len(events) == 0 {
						done++
						continue
					}
					if len(s.st.floorFrom) > 0 { // a floor read
						s.times = append(s.times, took)
						if proved {
							s.proved++
						}
					}
					ids := make([]int64, len(events))
					for j := range events {
						ids[j] = events[j].id
					}
					if _, err := pool.Exec(ctx, `DELETE FROM `+s.outbox+` WHERE id = ANY($1)`, ids); err != nil {
						b.Fatal(err)
					}
				}
			}
			med := func(xs []float64) float64 {
				slices.Sort(xs)
				return xs[len(xs)/2]
			}
			load, _ := os.ReadFile("/proc/loadavg")
			fmt.Printf("  pass %d: every descent %.2f (%d floor reads), with proofs %.2f (%d floor reads, %d with a proof)  load %s",
				pass+1, med(sides[0].times), len(sides[0].times), med(sides[1].times), len(sides[1].times), sides[1].proved, load)
			for _, s := range sides {
				pgtest.DropSchema(b, s.schema)
			}
		}
	}
}

// BenchmarkStuckKeyClaimSplit splits a drain's claims beside a stuck key
// (BenchmarkRelayStuckKey's data: 300,000 events of one key, blocked, then
// 50,000 of 1,000 other keys) against the same 50,000 without it, on two
// schemas, claim for claim in turn, each claim's round deleted by a range
// at once (no relay, no Kafka). It prints the medians of:
//   - the whole claim (store.claim: its batch, scanning, filters);
//   - the claim's read batch alone, rows read as raw bytes (what PostgreSQL
//     and the wire cost): the held read with and without the key-hash read
//     and the generic-plan settings, against one relay's primary-key read;
//
// and, on fresh connections, each statement text's first uses: preparing it
// (parse, analysis, describe) and three executions with its first claim's
// arguments on the drained table, so that the first one's excess over the
// others is building its generic plan. A relay's pool pays both once per
// connection and text.
//
//	go test -run '^$' -bench StuckKeyClaimSplit -benchtime 1x ./relay/
func BenchmarkStuckKeyClaimSplit(b *testing.B) {
	ctx := context.Background()
	pool := pgtest.Pool(b)
	type side struct {
		name    string
		st      *store
		schema  string
		outbox  string
		blocked []keyBlock
		claims  []float64
		batches map[string][]float64
		texts   []statement // the statements its claims sent, once each
	}
	timeBatch := func(s *side, name string, settings bool, stmts ...statement) {
		batch := &pgx.Batch{}
		if settings {
			batch.Queue(`SELECT set_config('enable_bitmapscan', 'off', true), set_config('plan_cache_mode', 'force_generic_plan', true)`)
		}
		for _, st := range stmts {
			batch.Queue(st.sql, st.args...).Query(func(rows pgx.Rows) error {
				for rows.Next() {
					rows.RawValues()
				}
				return rows.Err()
			})
		}
		start := time.Now()
		if err := pool.SendBatch(ctx, batch).Close(); err != nil {
			b.Fatal(err)
		}
		s.batches[name] = append(s.batches[name], float64(time.Since(start).Microseconds())/1000)
	}
	for range b.N {
		var sides [2]*side
		for i, name := range []string{"beside the stuck key", "without it"} {
			schema := pgtest.Schema(b)
			outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
			stuck := 300_000
			if i == 1 {
				stuck = 0
			}
			if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 'bench', CASE WHEN g <= $1 THEN 'stuck' ELSE 'key-' || (g % 1000) END::bytea, convert_to(repeat('x', 256), 'UTF8')
FROM generate_series(1, $1 + 50000) g`, stuck); err != nil {
				b.Fatal(err)
			}
			if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+outbox); err != nil {
				b.Fatal(err)
			}
			s := &side{name: name, st: newStore(pool, schema), schema: schema, outbox: outbox, batches: map[string][]float64{}}
			if stuck > 0 {
				var first int64
				if err := pool.QueryRow(ctx, `SELECT min(id) FROM `+outbox).Scan(&first); err != nil {
					b.Fatal(err)
				}
				s.blocked = []keyBlock{{key: []byte("stuck"), firstID: first}}
			}
			sides[i] = s
		}
		for done := 0; done < len(sides); {
			done = 0
			for _, s := range sides {
				stmts := s.st.claimStatements(everyShard(), 1000, s.blocked, nil)
				for _, st := range stmts {
					if !slices.ContainsFunc(s.texts, func(t statement) bool { return t.sql == st.sql }) {
						s.texts = append(s.texts, st)
					}
				}
				start := time.Now()
				events, err := s.st.claim(ctx, "bench", everyShard(), 1000, s.blocked, nil)
				if err != nil {
					b.Fatal(err)
				}
				took := float64(time.Since(start).Microseconds()) / 1000
				if len(events) == 0 {
					done++
					continue
				}
				s.claims = append(s.claims, took)
				switch {
				case len(stmts) == 2 && stmts[0].held != nil:
					timeBatch(s, "held read + key-hash read, generic", true, stmts...)
					timeBatch(s, "held read, generic", true, stmts[0])
					timeBatch(s, "key-hash read, generic", true, stmts[1])
				case len(stmts) == 1 && stmts[0].all:
					timeBatch(s, "primary-key read", false, stmts[0])
				}
				lo, hi := events[0].id, events[0].id
				for _, e := range events {
					lo, hi = min(lo, e.id), max(hi, e.id)
				}
				if _, err := pool.Exec(ctx, `DELETE FROM `+s.outbox+` WHERE id BETWEEN $1 AND $2`, lo, hi); err != nil {
					b.Fatal(err)
				}
			}
		}
		medianOf := func(xs []float64) float64 {
			slices.Sort(xs)
			return xs[len(xs)/2]
		}
		fmt.Printf("\nclaims of 1,000 through 50,000 events, beside a stuck key of 300,000 and without, in turn (medians, ms):\n")
		for _, s := range sides {
			fmt.Printf("  %-22s claim %.3f (%d claims)\n", s.name, medianOf(s.claims), len(s.claims))
			names := make([]string, 0, len(s.batches))
			for name := range s.batches {
				names = append(names, name)
			}
			slices.Sort(names)
			for _, name := range names {
				fmt.Printf("  %-22s   its batch alone, %-36s %.3f\n", "", name+":", medianOf(s.batches[name]))
			}
		}
		// First uses: each text the side beside the stuck key sent, on a new
		// connection whose catalog caches one read of the outbox warmed.
		fmt.Printf("first uses of each statement text the claims sent beside the stuck key, on a fresh connection (ms):\n")
		for _, st := range sides[0].texts {
			conn, err := pgx.Connect(ctx, pgtest.URL(b))
			if err != nil {
				b.Fatal(err)
			}
			if _, err := conn.Exec(ctx, `SELECT set_config('enable_bitmapscan', 'off', false), set_config('plan_cache_mode', 'force_generic_plan', false), count(*) FROM `+sides[0].outbox); err != nil {
				b.Fatal(err)
			}
			start := time.Now()
			if _, err := conn.Prepare(ctx, "first_use", st.sql); err != nil {
				b.Fatal(err)
			}
			prepare := float64(time.Since(start).Microseconds()) / 1000
			var runs []string
			for range 3 {
				start = time.Now()
				rows, _ := conn.Query(ctx, "first_use", st.args...)
				rows.Close()
				if err := rows.Err(); err != nil {
					b.Fatal(err)
				}
				runs = append(runs, fmt.Sprintf("%.2f", float64(time.Since(start).Microseconds())/1000))
			}
			kind := "shards' read"
			switch {
			case st.held != nil:
				kind = "held read"
			case st.sweepLimit > 0:
				kind = "key-hash read"
			case st.all:
				kind = "primary-key read"
			case st.floor:
				kind = "floor read"
			}
			fmt.Printf("  %-16s %5d bytes: prepare %.2f, executions %s\n", kind, len(st.sql), prepare, strings.Join(runs, " "))
			if err := conn.Close(ctx); err != nil {
				b.Fatal(err)
			}
		}
		for _, s := range sides {
			pgtest.DropSchema(b, s.schema)
		}
	}
}
