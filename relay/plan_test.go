package relay_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// With a backlog of 1M rows the relay's pending-rows query must read an
// index in id order and stop at the batch, never sort or scan the table.
func TestPendingQueryStaysOnIndexWith1MRows(t *testing.T) {
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
	// The claim's inner query, as store.go runs it, for a relay owning
	// every shard and for one owning a quarter.
	for _, shards := range [][]int16{allShards(256), allShards(64)} {
		var plan []string
		rows, err := pool.Query(ctx, `EXPLAIN (ANALYZE, BUFFERS) SELECT o.id FROM `+outbox+` o
WHERE o.shard = ANY($1::smallint[]) ORDER BY o.id LIMIT 1000`, shards)
		if err != nil {
			t.Fatal(err)
		}
		plan, err = pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		text := strings.Join(plan, "\n")
		t.Logf("%d shards owned:\n%s", len(shards), text)
		if strings.Contains(text, "Seq Scan") || strings.Contains(text, "Sort") {
			t.Fatalf("pending-rows query scans or sorts with a 1M backlog:\n%s", text)
		}
		if !strings.Contains(text, "Index") {
			t.Fatalf("pending-rows query uses no index:\n%s", text)
		}
	}
}

func allShards(n int) []int16 {
	out := make([]int16, n)
	for i := range out {
		out[i] = int16(i * (256 / n))
	}
	return out
}
