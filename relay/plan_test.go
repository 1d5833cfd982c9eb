package relay

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// With a backlog of 1M rows the relay's claim must read the primary key in
// id order and stop at the batch, never sort or scan the table, and test
// shard ownership and in-flight ids with hashed subplans (a hash probe per
// row), also under the generic plan PostgreSQL switches a prepared
// statement to after five runs.
func TestClaimStaysOnIndexWith1MRows(t *testing.T) {
	if testing.Short() {
		t.Skip("inserts 1M rows; skipped with -short")
	}
	t.Parallel()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	ctx := context.Background()
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 'bench', ('key-' || (g % 1000))::bytea, repeat('x', 64)::bytea FROM generate_series(1, 1000000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE `+outbox); err != nil {
		t.Fatal(err)
	}
	var firstID int64
	if err := pool.QueryRow(ctx, `SELECT min(id) FROM `+outbox).Scan(&firstID); err != nil {
		t.Fatal(err)
	}
	// Rounds in flight: the oldest 1,000 events, as one run of ids or with
	// a gap (which takes the NOT IN form).
	run := make([]int64, 1000)
	for i := range run {
		run[i] = firstID + int64(i)
	}
	gapped := append(slices.Clone(run[:500]), run[501:]...)
	st := newStore(pool, schema)

	for _, c := range []struct {
		name     string
		owned    []int16
		excluded []int64
		merged   bool // the read is two index ranges around a run
	}{
		{"every shard", everyShard(), nil, false},
		{"a quarter of the shards", everyShard()[:NumShards/4], nil, false},
		{"every shard, a gapped round in flight", everyShard(), gapped, false},
		{"every shard, a round of consecutive ids in flight", everyShard(), run, true},
		{"a quarter of the shards, a round of consecutive ids in flight", everyShard()[:NumShards/4], run, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			notOwned := everyShard()[len(c.owned):]
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			if _, err := tx.Exec(ctx, `SET LOCAL plan_cache_mode = force_generic_plan`); err != nil {
				t.Fatal(err)
			}
			claimSQL, args := st.claimSQL[0][0], fmt.Sprintf(`'%s', 1000, '%s'`, pgArray(notOwned), pgArray(c.excluded))
			if lo, hi, ok := oneRun(slices.Clone(c.excluded)); ok {
				claimSQL, args = st.claimSQL[1][0], fmt.Sprintf(`'%s', 1000, %d, %d`, pgArray(notOwned), lo, hi)
			}
			if _, err := tx.Exec(ctx, `PREPARE claim AS `+claimSQL); err != nil {
				t.Fatal(err)
			}
			rows, _ := tx.Query(ctx, `EXPLAIN (ANALYZE, BUFFERS) EXECUTE claim(`+args+`)`, pgx.QueryExecModeSimpleProtocol)
			plan, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, `DEALLOCATE claim`); err != nil { // prepared statements outlive the transaction
				t.Fatal(err)
			}
			text := strings.Join(plan, "\n")
			t.Logf("%s:\n%s", c.name, text)
			for _, bad := range []string{"Seq Scan on outbox", "Sort  (", "Bitmap"} {
				if strings.Contains(text, bad) {
					t.Errorf("claim plan has %q with a 1M backlog", bad)
				}
			}
			good := []string{"Index Scan using outbox_pkey", "hashed SubPlan"}
			if c.merged {
				good = append(good, "Merge Append", "Index Cond: (id < $3)", "Index Cond: (id > $4)")
			}
			for _, g := range good {
				if !strings.Contains(text, g) {
					t.Errorf("claim plan lacks %q", g)
				}
			}
		})
	}
}

// pgArray renders integers as a PostgreSQL array literal.
func pgArray[T int16 | int64](xs []T) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprint(x)
	}
	return "{" + strings.Join(parts, ",") + "}"
}
