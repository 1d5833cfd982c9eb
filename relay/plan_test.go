package relay

import (
	"context"
	"fmt"
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
	inFlight := make([]int64, 1000) // a round in flight: the oldest 1,000
	for i := range inFlight {
		inFlight[i] = firstID + int64(i)
	}
	claimSQL := newStore(pool, schema).claimSQL

	for _, c := range []struct {
		name     string
		owned    []int16
		excluded []int64
	}{
		{"every shard", everyShard(), nil},
		{"a quarter of the shards", everyShard()[:NumShards/4], nil},
		{"every shard, a round in flight", everyShard(), inFlight},
	} {
		t.Run(c.name, func(t *testing.T) {
			notOwned := everyShard()[len(c.owned):]
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx) // the claim records its round
			if _, err := tx.Exec(ctx, `SET LOCAL plan_cache_mode = force_generic_plan`); err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, `PREPARE claim AS `+claimSQL); err != nil {
				t.Fatal(err)
			}
			rows, _ := tx.Query(ctx, fmt.Sprintf(`EXPLAIN (ANALYZE, BUFFERS) EXECUTE claim('%s', 1000, 'plan-test', '%s', '%s')`,
				pgArray(notOwned), pgArray(c.excluded), pgArray(c.owned)), pgx.QueryExecModeSimpleProtocol)
			plan, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, `DEALLOCATE claim`); err != nil { // prepared statements outlive the transaction
				t.Fatal(err)
			}
			text := strings.Join(plan, "\n")
			t.Logf("%s:\n%s", c.name, text)
			for _, bad := range []string{"Seq Scan on outbox", "Sort", "Bitmap"} {
				if strings.Contains(text, bad) {
					t.Errorf("claim plan has %q with a 1M backlog", bad)
				}
			}
			for _, good := range []string{"Index Scan using outbox_pkey", "hashed SubPlan"} {
				if !strings.Contains(text, good) {
					t.Errorf("claim plan lacks %q", good)
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
