package relay

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// With a backlog of 1M rows (300,000 of one key, then 700,000 over 1,000
// keys) the relay's claim touches only what it may publish, also under the
// generic plan PostgreSQL switches a prepared statement to after five runs:
// one relay reads the primary key in id order; a relay owning a quarter of
// the shards reads only those shards' index ranges (not the other relays'
// rows, nor the 300,000-event key's when it is in another relay's shard);
// a key blocked with 300,000 events is stepped over, not walked, and its
// shard's other events are read by key hash only as far as the round
// needs (claimBlockedQuery), not read whole and sorted. Each read
// stays far below the rows it would walk otherwise (a budget of buffer
// accesses and of rows read and dropped), never scans the table, is
// estimated cheap enough that PostgreSQL does not JIT-compile it (which
// took 0.3-10 s per claim with some early shapes), and runs no parallel
// workers (for a round's worth of index ranges, their start-up would cost
// more than the read).
func TestClaimTouchesOnlyWhatItMayPublishWith1MRows(t *testing.T) {
	if testing.Short() {
		t.Skip("inserts 1M rows; skipped with -short")
	}
	t.Parallel()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	ctx := context.Background()
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 'bench', CASE WHEN g <= 300000 THEN 'stuck' ELSE 'key-' || (g % 1000) END::bytea, repeat('x', 64)::bytea
FROM generate_series(1, 1000000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+outbox); err != nil {
		t.Fatal(err)
	}
	var firstID int64
	if err := pool.QueryRow(ctx, `SELECT min(id) FROM `+outbox).Scan(&firstID); err != nil {
		t.Fatal(err)
	}
	stuckShard := int16(sha256.Sum256([]byte("stuck"))[0])
	stuck := []keyBlock{{key: []byte("stuck"), firstID: firstID}}
	// Rounds in flight: the oldest 1,000 events, as one run of ids or with
	// a gap (which takes the NOT IN form).
	run := make([]int64, 1000)
	for i := range run {
		run[i] = firstID + int64(i)
	}
	gapped := append(slices.Clone(run[:500]), run[501:]...)
	// Rounds in flight past the stuck key's events (a read-ahead beside it).
	pastStuck := make([]int64, 2000)
	for i := range pastStuck {
		pastStuck[i] = firstID + 300_000 + int64(i)
	}
	gappedPastStuck := append(slices.Clone(pastStuck[:700]), pastStuck[701:]...)
	// A quarter of the shards, with and without the stuck key's.
	var quarter, quarterWithStuck []int16
	for sh := int16(0); sh < NumShards; sh++ {
		if sh != stuckShard && len(quarter) < NumShards/4 {
			quarter = append(quarter, sh)
		}
	}
	quarterWithStuck = append(slices.Clone(quarter[1:]), stuckShard)
	slices.Sort(quarterWithStuck)
	st := newStore(pool, schema)
	st.maxBytes = 16 << 20 // as the relay runs it (Config.BatchBytes)

	for _, c := range []struct {
		name     string
		owned    []int16
		blocked  []keyBlock
		excluded []int64
		want     []string // in the plan
		whole    bool     // the last round was whole (store.lastFull)
		base     int64    // the lowest id of the earlier floor reads (store.floorFrom), 0 for none
		proof    bool     // a floor proof (claimproof.go) at base holds every shard but the stuck key's (every shard if none is blocked)
	}{
		{"every shard", everyShard(), nil, nil, []string{"Index Scan using outbox_pkey", "hashed SubPlan"}, false, 0, false},
		{"every shard, a gapped round in flight", everyShard(), nil, gapped, []string{"Index Scan using outbox_pkey", "hashed SubPlan"}, false, 0, false},
		{"every shard, a round of consecutive ids in flight", everyShard(), nil, run,
			[]string{"Merge Append", "Index Cond: (id < $1)", "Index Cond: (id > $2)"}, false, 0, false},
		{"a quarter of the shards, the stuck key's in another relay's", quarter, nil, nil,
			[]string{"Merge Append", "Index Scan using outbox_shard_id_idx", "hashed SubPlan"}, false, 0, false},
		{"a quarter of the shards, a round in flight", quarter, nil, run,
			[]string{"Merge Append", "Index Scan using outbox_shard_id_idx", "hashed SubPlan"}, false, 0, false},
		{"every shard, the stuck key blocked", everyShard(), stuck, nil,
			[]string{"Nested Loop", "Index Scan using outbox_shard_id_idx", "hashed SubPlan", "outbox_key_hash_idx"}, false, 0, false},
		{"every shard, the stuck key blocked, a round in flight", everyShard(), stuck, gapped,
			[]string{"Nested Loop", "Index Scan using outbox_shard_id_idx", "hashed SubPlan", "outbox_key_hash_idx"}, false, 0, false},
		{"a quarter of the shards with the stuck key's, the key blocked, a round in flight", quarterWithStuck, stuck, gapped,
			[]string{"Merge Append", "outbox_key_hash_idx"}, false, 0, false},
		{"every shard, the stuck key blocked, the last round whole", everyShard(), stuck, nil,
			[]string{"Index Scan using outbox_pkey", "Index Only Scan using outbox_shard_id_idx", "InitPlan", "outbox_key_hash_idx"}, true, 0, false},
		{"every shard, the stuck key blocked, the last round whole, a round in flight", everyShard(), stuck, gapped,
			[]string{"Index Scan using outbox_pkey", "InitPlan", "hashed SubPlan", "outbox_key_hash_idx"}, true, 0, false},
		// The floor's descents stop at the base (the events past the stuck
		// key's) and the read steps over the rounds in flight.
		{"every shard, the stuck key blocked, the last rounds whole, a round of consecutive ids in flight", everyShard(), stuck, pastStuck,
			[]string{"Index Only Scan using outbox_shard_id_idx", "CTE f", "Merge Append", "Index Cond: ((id >= $", "outbox_key_hash_idx"}, true, firstID + 300_000, false},
		{"every shard, the stuck key blocked, the last rounds whole, a gapped round in flight", everyShard(), stuck, gappedPastStuck,
			[]string{"Index Only Scan using outbox_shard_id_idx", "CTE f", "Merge Append", "hashed SubPlan", "outbox_key_hash_idx"}, true, firstID + 300_000, false},
		// With a floor proof the descents are not run at all; with the
		// rounds in flight one run, the claim reads through the primary
		// key from the proof's id and drops the stuck key's events itself
		// (a held read).
		{"every shard, the stuck key blocked, the last rounds whole, a floor proof, a round of consecutive ids in flight", everyShard(), stuck, pastStuck,
			[]string{"Merge Append", "(id >= $3)", "(id < $1)", "(id > $2)", "outbox_key_hash_idx"}, true, firstID + 300_000, true},
		{"every shard, the stuck key blocked, the last rounds whole, a floor proof, a gapped round in flight", everyShard(), stuck, gappedPastStuck,
			[]string{"CTE f", "Merge Append", "hashed SubPlan", "outbox_key_hash_idx"}, true, firstID + 300_000, true},
		// A floor proof that holds every shard: the read through the
		// primary key starts at its id.
		{"every shard, a floor proof, a gapped round in flight", everyShard(), nil, gappedPastStuck,
			[]string{"Index Scan using outbox_pkey", "Index Cond: (id >= $2)", "hashed SubPlan"}, false, firstID + 300_000, true},
		{"every shard, a floor proof, a round of consecutive ids in flight", everyShard(), nil, pastStuck,
			[]string{"Merge Append", "(id >= $3)", "(id < $1)", "(id > $2)"}, false, firstID + 300_000, true},
		// A floor proof that holds a relay's shards: each shard's range
		// starts at its id, not at the index's left edge.
		{"a quarter of the shards, a floor proof, a round in flight", quarter, nil, gappedPastStuck,
			[]string{"Merge Append", "Index Scan using outbox_shard_id_idx", "(id >= ($2)[1])", "(id >= ($2)[64])", "hashed SubPlan"}, false, firstID + 300_000, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			var plans []string
			st.lastFull = c.whole
			st.floorFrom = nil
			if c.base != 0 {
				st.floorFrom = []int64{c.base}
			}
			// The base and the proof come from reads of the claim's own
			// shape (floorShape).
			switch {
			case c.blocked == nil && len(c.owned) == NumShards:
				st.floorKind = shapeAll
			case c.blocked == nil:
				st.floorKind = shapeShards
			default:
				st.floorKind = shapeFloor
			}
			st.proof = floorProof{}
			if c.proof {
				st.proof.below = c.base
				for sh := int16(0); sh < NumShards; sh++ {
					if sh != stuckShard || c.blocked == nil {
						st.proof.sure[sh/64] |= 1 << (sh % 64)
					}
				}
			}
			for _, stmt := range st.claimStatements(c.owned, 1000, c.blocked, slices.Clone(c.excluded)) {
				plans = append(plans, explainGeneric(t, stmt))
			}
			text := strings.Join(plans, "\n---\n")
			t.Logf("%s:\n%s", c.name, text)
			for _, bad := range []string{"Seq Scan on outbox", "JIT", "Gather"} {
				if strings.Contains(text, bad) {
					t.Errorf("claim plan has %q with a 1M backlog", bad)
				}
			}
			// Under a floor proof no shard is descended: the descents'
			// index scan is in the plan but never runs (or, in a held
			// read, not in it).
			neverRun := regexp.MustCompile(`Index Only Scan using outbox_shard_id_idx on outbox p .*\(never executed\)`).MatchString(text)
			run := strings.Contains(text, "Index Only Scan using outbox_shard_id_idx on outbox p") && !neverRun
			if floorProved := c.proof && c.blocked != nil; floorProved && run || !floorProved && neverRun {
				t.Errorf("the floor's descents run: %v, never run: %v, with a floor proof: %v", run, neverRun, floorProved)
			}
			for _, g := range c.want {
				if !strings.Contains(text, g) {
					t.Errorf("claim plan lacks %q", g)
				}
			}
			// A floor read's branches the runs in flight leave unused
			// (floorBranches) are never run.
			if strings.Contains(text, "CTE f") {
				runs, _ := skipRuns(slices.Clone(c.excluded))
				unused := regexp.MustCompile(`Index Scan using outbox_pkey on outbox o\S*\s+\(cost=[^)]*\) \(never executed\)`).FindAllString(text, -1)
				if want := claimFloorSkips - len(runs); len(unused) < want {
					t.Errorf("%d of the floor read's branches never ran, want at least the %d unused ones", len(unused), want)
				}
			}
			// Walking the stuck key's rows or another relay's shards
			// would cost hundreds of thousands of each.
			for _, plan := range plans {
				if n := topBuffers(plan); n > 20_000 {
					t.Errorf("claim touched %d buffers", n)
				}
				// A shard holding a blocked key is read by key hash up
				// to the round's size, not sorted whole (4,100 buffers
				// here when it was: its 2,700 other events and more).
				if n := topBuffers(plan); strings.Contains(plan, "outbox_key_hash_idx") && n > 2_000 {
					t.Errorf("the blocked shard's read touched %d buffers, want at most 2,000 for a round of 1,000", n)
				}
				// The other 255 shards, each read its share of the round
				// (8 events) by (shard, id): about 11 buffers each.
				if n := topBuffers(plan); strings.Contains(plan, "Nested Loop") && n > 3_500 {
					t.Errorf("the free shards' read touched %d buffers, want at most 3,500 for 255 shards", n)
				}
			}
			for _, m := range regexp.MustCompile(`Rows Removed by Filter: (\d+)`).FindAllStringSubmatch(text, -1) {
				if n, _ := strconv.Atoi(m[1]); n > 2_000 {
					t.Errorf("claim read and dropped %d rows", n)
				}
			}
		})
	}
}

// explainGeneric runs EXPLAIN ANALYZE of stmt prepared under a generic plan.
func explainGeneric(t testing.TB, stmt statement) string {
	t.Helper()
	ctx := context.Background()
	tx, err := pgtest.Pool(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SET LOCAL plan_cache_mode = force_generic_plan`); err != nil {
		t.Fatal(err)
	}
	if stmt.noBitmap { // as claim runs it
		if _, err := tx.Exec(ctx, `SET LOCAL enable_bitmapscan = off`); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := tx.Exec(ctx, `PREPARE claim AS `+stmt.sql); err != nil {
		t.Fatal(err)
	}
	defer tx.Exec(ctx, `DEALLOCATE claim`) // prepared statements outlive the transaction
	args := make([]string, len(stmt.args))
	for i, a := range stmt.args {
		args[i] = sqlLiteral(a)
	}
	rows, _ := tx.Query(ctx, `EXPLAIN (ANALYZE, BUFFERS) EXECUTE claim(`+strings.Join(args, ", ")+`)`, pgx.QueryExecModeSimpleProtocol)
	plan, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(plan, "\n")
}

// topBuffers returns the buffer accesses of a plan's top node.
func topBuffers(plan string) int {
	m := regexp.MustCompile(`Buffers: shared hit=(\d+)(?: read=(\d+))?`).FindStringSubmatch(plan)
	if m == nil {
		return 0
	}
	hit, _ := strconv.Atoi(m[1])
	read, _ := strconv.Atoi(m[2])
	return hit + read
}

// sqlLiteral renders a claim argument as SQL.
func sqlLiteral(a any) string {
	switch v := a.(type) {
	case int:
		return fmt.Sprint(v)
	case int64:
		return fmt.Sprint(v)
	case string:
		return "'" + strings.ReplaceAll(v, "'", "''") + "'"
	case []int64:
		return "'" + pgArray(v) + "'::bigint[]"
	case []int16:
		return "'" + pgArray(v) + "'::int2[]"
	case []int32:
		return "'" + pgArray(v) + "'::int4[]"
	case []string:
		parts := make([]string, len(v))
		for i, s := range v {
			parts[i] = sqlLiteral(s)
		}
		return "ARRAY[" + strings.Join(parts, ", ") + "]::text[]"
	case []bool:
		parts := make([]string, len(v))
		for i, b := range v {
			parts[i] = strconv.FormatBool(b)
		}
		return "ARRAY[" + strings.Join(parts, ", ") + "]::boolean[]"
	case []byte:
		return `'\x` + hex.EncodeToString(v) + `'::bytea`
	case [][]byte:
		parts := make([]string, len(v))
		for i, b := range v {
			parts[i] = `'\x` + hex.EncodeToString(b) + `'::bytea`
		}
		return "ARRAY[" + strings.Join(parts, ", ") + "]::bytea[]"
	}
	panic(fmt.Sprintf("sqlLiteral: %T", a))
}

// pgArray renders integers as a PostgreSQL array literal.
func pgArray[T int16 | int32 | int64](xs []T) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprint(x)
	}
	return "{" + strings.Join(parts, ",") + "}"
}
