package relay

import (
	"crypto/sha256"
	"slices"
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

// Once the rounds are whole, the free shards beside a blocked key are read
// through the primary key from their floor (claimFloorQuery): the round is
// exactly the oldest pending events not of the blocked key, whichever
// shard they are in, and the blocked key's events below the floor (a key
// stuck with the oldest events of the table) are not read.
func TestClaimReadsTheFreeShardsFromTheirFloorPastABlockedKey(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	pool := pgtest.Pool(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	stuckFirst := insert(pool, "stuck")
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', 'stuck'::bytea FROM generate_series(1, 500)`); err != nil {
		t.Fatal(err)
	}
	// The other keys, one of them in the stuck key's shard.
	keys := append(keysInShard(sha256.Sum256([]byte("stuck"))[0], 1, "stuck"), "a", "b", "c", "d", "e")
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ($1::text[])[1 + g % 6]::bytea FROM generate_series(1, 450) g`, keys); err != nil {
		t.Fatal(err)
	}
	blocked := []keyBlock{{key: []byte("stuck"), firstID: stuckFirst}}
	st.lastFull = true
	for round := range 4 { // while at least a round is pending
		stmts := st.claimStatements(everyShard(), 100, blocked, nil)
		if stmts[0].short == nil {
			t.Fatalf("claim %d: the free shards are not read from their floor", round)
		}
		var want []int64
		rows, _ := pool.Query(ctx, `SELECT id FROM `+outbox+` WHERE key <> 'stuck' ORDER BY id LIMIT 100`)
		want, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		got := claimedIDs(t, st, everyShard(), 100, blocked, nil)
		if !slices.Equal(got, want) {
			t.Fatalf("claim %d read %v, want the oldest events not of the blocked key %v", round, got, want)
		}
		if _, err := pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, got); err != nil {
			t.Fatal(err)
		}
	}
}

// Where the rows the floor's walk must drop (a blocked key's events above
// the floor) are denser than the round, the walk stops short of it and the
// claim reads the free shards by their shares instead, which grow for the
// shards that fill them until the rounds are whole; the claims after one
// such whole round read by shares directly, for a while.
func TestClaimReadsByTheFreeShardsSharesWhereABlockedKeyIsDenseAboveTheFloor(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	pool := pgtest.Pool(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	stuckFirst := insert(pool, "stuck")
	// Five events of the stuck key for every other one.
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', CASE WHEN g % 6 = 0 THEN 'other-' || (g % 7) ELSE 'stuck' END::bytea FROM generate_series(1, 6000) g`); err != nil {
		t.Fatal(err)
	}
	blocked := []keyBlock{{key: []byte("stuck"), firstID: stuckFirst}}
	st.lastFull = true
	var sizes []int
	for len(sizes) == 0 || sizes[len(sizes)-1] < 100 {
		if len(sizes) == 6 {
			t.Fatalf("round sizes %v: never a whole round", sizes)
		}
		events, err := st.claim(ctx, "me", everyShard(), 100, blocked, nil)
		if err != nil {
			t.Fatal(err)
		}
		byKey := map[string][]int64{}
		var ids []int64
		for _, e := range events {
			if string(e.key) == "stuck" {
				t.Fatalf("claim read the blocked key's event %d", e.id)
			}
			byKey[string(e.key)] = append(byKey[string(e.key)], e.id)
			ids = append(ids, e.id)
		}
		for k, got := range byKey {
			rows, _ := pool.Query(ctx, `SELECT id FROM `+outbox+` WHERE key = $1::bytea ORDER BY id LIMIT $2`, k, len(got))
			want, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, want) {
				t.Fatalf("claim read %v of key %s, want a prefix of its pending events %v", got, k, want)
			}
		}
		sizes = append(sizes, len(events))
		if _, err := pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, ids); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("round sizes: %v", sizes)
	if stmts := st.claimStatements(everyShard(), 100, blocked, nil); stmts[0].short != nil {
		t.Error("the claim after a whole round by shares reads from the floor again")
	}
}
