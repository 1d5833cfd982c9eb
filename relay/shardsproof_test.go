package relay

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// An outbox whose identity hands out ids at or below 0 (MINVALUE lowered,
// RESTART WITH -100): a relay owning some shards, with no floor proof,
// reads them as it did before claimShardsQuery's ranges started at $2's
// 0 for "no proof" (a cold review, helper 58).
func TestShardsReadWithoutAProofReadsIdsBelowOne(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := pool.Exec(ctx, `ALTER TABLE `+outbox+` ALTER COLUMN id SET MINVALUE -100 RESTART WITH -100`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key) SELECT 't', 'k'::bytea FROM generate_series(1, 200)`); err != nil {
		t.Fatal(err)
	}
	st := newStore(pool, schema)
	sh := int16(shardOf("k"))
	got := claimedIDs(t, st, []int16{sh}, 50, nil, nil)
	if len(got) == 0 || got[0] != -100 {
		t.Fatalf("a relay owning shard %d read %v, want the key's events from id -100 on", sh, got)
	}
	all := claimedIDs(t, newStore(pool, schema), everyShard(), 50, nil, nil)
	t.Logf("one relay owning every shard reads %v...", all[:3])
}

// A relay owning some of the shards confirms its floor proofs over those
// shards only: the others, another relay's, would be descended from their
// left edge at every confirm (past every row their owner deleted) for a
// proof this relay never reads them with (a cold review, helper 58,
// measured 50,488 buffers a confirm, 46,957 of them in the 192 shards not
// owned). So a proof it confirms holds none of them, not even the empty.
func TestAShardsReadsProofConfirmsOnlyItsShards(t *testing.T) {
	t.Parallel()
	ctx, st, schema, _ := claimSetup(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	var quarter []int16
	for sh := int16(0); sh < NumShards/4; sh++ {
		quarter = append(quarter, sh)
	}
	// Events in every shard, then the unowned shards' drained (by their
	// owners): empty, they would be held by a confirm of every shard.
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key) SELECT 't', ('k' || g)::bytea FROM generate_series(1, 20000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE shard >= $1`, NumShards/4); err != nil {
		t.Fatal(err)
	}
	for i := 0; st.proof.below == 0; i++ {
		if i == 40 {
			t.Fatal("no floor proof within 40 claims of a quarter of the shards")
		}
		got := claimedIDs(t, st, quarter, 50, nil, nil)
		if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, got); err != nil {
			t.Fatal(err)
		}
	}
	for sh := int16(NumShards / 4); sh < NumShards; sh++ {
		if st.proof.holds(sh) {
			t.Fatalf("the proof holds shard %d, which this relay does not own: its confirm descended every shard", sh)
		}
	}
	held := 0
	for _, sh := range quarter {
		if st.proof.holds(sh) {
			held++
		}
	}
	if held == 0 {
		t.Fatal("the proof holds none of the relay's own shards")
	}
}
