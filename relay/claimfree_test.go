package relay

import (
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// With a key blocked, the other 255 shards are each read their share of
// the round (claimFreeQuery). A hot key of another shard must still get
// whole rounds within a few claims, in id order, and a quiet shard's event
// must not wait behind it.
func TestClaimGivesAHotFreeShardWholeRoundsWhileAKeyIsBlocked(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	pool := pgtest.Pool(t)
	stuckFirst := insert(pool, "stuck")
	insert(pool, "stuck")
	if _, err := pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "outbox"}.Sanitize()+` (topic, key)
SELECT 't', 'hot'::bytea FROM generate_series(1, 2000)`); err != nil {
		t.Fatal(err)
	}
	quiet := insert(pool, "quiet")
	blocked := []keyBlock{{key: []byte("stuck"), firstID: stuckFirst}}
	var last int64
	var sizes []int
	sawQuiet := false
	for len(sizes) == 0 || sizes[len(sizes)-1] < 100 {
		if len(sizes) == 12 {
			t.Fatalf("round sizes %v: the hot shard never got a whole round", sizes)
		}
		events, err := st.claim(ctx, "me", everyShard(), 100, blocked, nil)
		if err != nil {
			t.Fatal(err)
		}
		var ids []int64
		for _, e := range events {
			ids = append(ids, e.id)
			switch string(e.key) {
			case "stuck":
				t.Fatalf("claim read the blocked key's event %d", e.id)
			case "quiet":
				sawQuiet = sawQuiet || e.id == quiet
				continue
			}
			if e.id <= last {
				t.Fatalf("hot key's event %d after %d", e.id, last)
			}
			last = e.id
		}
		sizes = append(sizes, len(events))
		if _, err := pool.Exec(ctx, `DELETE FROM `+pgx.Identifier{schema, "outbox"}.Sanitize()+` WHERE id = ANY($1)`, ids); err != nil {
			t.Fatal(err)
		}
	}
	if !sawQuiet {
		t.Errorf("the quiet key's event was never claimed (rounds %v)", sizes)
	}
	t.Logf("round sizes: %v", sizes)
}
