package relay

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// onePoolStore returns a store on a pool of one connection (so every claim
// prepares its statements where preparedPlans reads them) over a fresh
// schema holding 3,000 events of the key "stuck", then 17,000 over 100
// other keys.
func onePoolStore(t *testing.T) (context.Context, *store, *pgxpool.Pool, int64) {
	t.Helper()
	ctx := context.Background()
	schema := pgtest.Schema(t)
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 't', CASE WHEN g <= 3000 THEN 'stuck' ELSE 'key-' || (g % 100) END::bytea, '\x00'::bytea
FROM generate_series(1, 20000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE `+outbox); err != nil {
		t.Fatal(err)
	}
	var firstID int64
	if err := pool.QueryRow(ctx, `SELECT min(id) FROM `+outbox).Scan(&firstID); err != nil {
		t.Fatal(err)
	}
	return ctx, newStore(pool, schema), pool, firstID
}

// preparedPlans checks that every statement prepared on the pool's
// connection whose text contains marker ran its generic plan only, and
// that there was one.
func preparedPlans(t *testing.T, pool *pgxpool.Pool, marker string, claims int) {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements`)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for rows.Next() {
		var text string
		var generic, custom int64
		if err := rows.Scan(&text, &generic, &custom); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(text, marker) {
			continue
		}
		found = true
		if custom > 0 {
			t.Errorf("a claim statement was planned for its arguments %d times in %d claims (generic plan %d times), want its generic plan every time:\n%.300s", custom, claims, generic, text)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if !found {
		t.Fatalf("no prepared statement holds %q", marker)
	}
}

// The read of a shard holding a blocked key runs on its prepared statement's
// generic plan from the first claim on. PostgreSQL's own choice kept custom
// plans for it for good (the generic plan's estimate is above the custom
// ones'), planning its key-hash ranges afresh on every claim: 1.5 ms of a
// 2 ms read, on every round beside a stuck key. The generic plan is the one
// TestClaimTouchesOnlyWhatItMayPublishWith1MRows checks.
func TestBlockedShardReadRunsItsGenericPlan(t *testing.T) {
	t.Parallel()
	ctx, st, pool, firstID := onePoolStore(t)
	blocked := []keyBlock{{key: []byte("stuck"), firstID: firstID}}
	const claims = 12
	for range claims {
		events, err := st.claim(ctx, "test", everyShard(), 100, blocked, nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(events) == 0 {
			t.Fatal("nothing claimed beside the blocked key")
		}
		for i := range events {
			if string(events[i].key) == "stuck" {
				t.Fatalf("claimed event %d of the blocked key", events[i].id)
			}
		}
	}
	preparedPlans(t, pool, keyHashSQL, claims)
}

// So does a relay's read of the shards it owns when it owns some, not all
// (one of four relays): PostgreSQL planned its 64 index ranges for the
// arguments five times on every pool connection before it took the
// generic plan, 5 ms a plan; four relays' pools made 69 such plans in a
// 300,000-event drain.
func TestShardsReadRunsItsGenericPlan(t *testing.T) {
	t.Parallel()
	ctx, st, pool, _ := onePoolStore(t)
	var quarter []int16
	for sh := int16(0); sh < NumShards; sh += 4 {
		quarter = append(quarter, sh)
	}
	const claims = 8
	for range claims {
		events, err := st.claim(ctx, "test", quarter, 100, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(events) == 0 {
			t.Fatal("nothing claimed from a quarter of the shards")
		}
		ids := make([]int64, len(events))
		for i := range events {
			ids[i] = events[i].id
		}
		if _, err := pool.Exec(ctx, `DELETE FROM `+st.outbox+` WHERE id = ANY($1)`, ids); err != nil {
			t.Fatal(err)
		}
	}
	preparedPlans(t, pool, "o.shard = 4 AND o.id >= ", claims)
}
