package relay

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// The read of a shard holding a blocked key runs on its prepared statement's
// generic plan from the first claim on. PostgreSQL's own choice kept custom
// plans for it for good (the generic plan's estimate is above the custom
// ones'), planning its key-hash ranges afresh on every claim: 1.5 ms of a
// 2 ms read, on every round beside a stuck key. The generic plan is the one
// TestClaimTouchesOnlyWhatItMayPublishWith1MRows checks.
func TestBlockedShardReadRunsItsGenericPlan(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := pgtest.Schema(t)
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1 // every claim on the connection whose statements are read below
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
	st := newStore(pool, schema)
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
	var found bool
	rows, err := pool.Query(ctx, `SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var text string
		var generic, custom int64
		if err := rows.Scan(&text, &generic, &custom); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(text, "outbox_key_hash") && !strings.Contains(text, keyHashSQL) {
			continue
		}
		found = true
		if custom > 0 {
			t.Errorf("the blocked shard's read was planned for its arguments %d times in %d claims (generic plan %d times), want its generic plan every time", custom, claims, generic)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if !found {
		t.Fatal("no prepared statement reads by key hash: the blocked shard was not read")
	}
}
