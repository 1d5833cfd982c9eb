package relay

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// finish's ownership re-check must decide the round as a whole: the
// acknowledged events of shards this relay held all along are deleted,
// whatever else happens to relay_shards while the outcome is recorded.
// Here the relay takes one more (free) shard while finish runs, as
// leases.tick's takeSQL does beside a record in flight: the range delete
// of the longest run sees the old set of shards, the "= ANY" delete of the
// rest, a later snapshot, sees the new one and deletes nothing. Before the
// fix the sum was not 0, so the row-by-row fallback (deleteOwnedSQL) never
// ran and the rest stayed pending, to be published again.
func TestFinishDeletesEveryAckedEventOfAHeldShardWhileAShardIsTaken(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	shardsTable := pgx.Identifier{schema, "relay_shards"}.Sanitize()
	var ids []int64
	for i := range 200 {
		ids = append(ids, insert(st.pool, fmt.Sprint("k", i%7)))
	}
	var used []int16
	if err := st.pool.QueryRow(ctx, `SELECT array_agg(DISTINCT shard) FROM `+outbox).Scan(&used); err != nil {
		t.Fatal(err)
	}
	x := int16(0) // a shard with no event, free: taken while finish runs
	for slices.Contains(used, x) {
		x++
	}
	if _, err := st.pool.Exec(ctx, `UPDATE `+shardsTable+` SET owner = 'me', lease_until = now() + interval '1 hour' WHERE shard <> $1`, x); err != nil {
		t.Fatal(err)
	}
	held := slices.DeleteFunc(everyShard(), func(s int16) bool { return s == x })
	acked := append([]int64{ids[5]}, ids[10:110]...)
	acked = append(acked, ids[150])

	// Another session holds the first row of the run, so the range delete
	// waits (in its snapshot) while the shard is taken.
	other := pgtest.Conn(t)
	tx, err := other.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT 1 FROM `+outbox+` WHERE id = $1 FOR UPDATE`, ids[10]); err != nil {
		t.Fatal(err)
	}
	type result struct {
		deleted int64
		err     error
	}
	done := make(chan result, 1)
	go func() {
		f, err := st.finish(ctx, "me", held, nil, acked, nil, nil, roundKey{ids[5], ids[150]})
		done <- result{f.deleted, err}
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting int
		if err := st.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND query LIKE 'DELETE FROM ' || $1 || '%'`, outbox).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("finish's delete never waited for the locked row")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := tx.Exec(ctx, `UPDATE `+shardsTable+` SET owner = 'me', lease_until = now() + interval '1 hour' WHERE shard = $1`, x); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	res := <-done
	if res.err != nil {
		t.Fatal(res.err)
	}
	rows, _ := st.pool.Query(context.Background(), `SELECT id FROM `+outbox+` WHERE id = ANY($1) ORDER BY id`, acked)
	left, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	if len(left) > 0 || res.deleted != int64(len(acked)) {
		t.Errorf("finish reported %d of %d acknowledged events deleted and left %v pending, on shards this relay held throughout (they will be published again)",
			res.deleted, len(acked), left)
	}
}

// An event of a shard the relay holds throughout, deleted by another
// session while finish's row-by-row delete waits for its row, is gone,
// not left to a shard's new owner: counting the ids still present in the
// statement's snapshot reported it as ownership lost (helper 73).
func TestFinishCountsARowDeletedMeanwhileAsGoneNotLeftToOthers(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	var ids []int64
	for i := range 10 {
		ids = append(ids, insert(st.pool, fmt.Sprint("k", i)))
	}
	var used []int16
	if err := st.pool.QueryRow(ctx, `SELECT array_agg(DISTINCT shard) FROM `+outbox).Scan(&used); err != nil {
		t.Fatal(err)
	}
	x := int16(0) // a shard with no event, taken after the round was read
	for slices.Contains(used, x) {
		x++
	}
	if _, err := st.pool.Exec(ctx, `UPDATE `+pgx.Identifier{schema, "relay_shards"}.Sanitize()+` SET owner = 'me', lease_until = now() + interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	roundShards := slices.DeleteFunc(everyShard(), func(s int16) bool { return s == x })
	other := pgtest.Conn(t)
	tx, err := other.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	type result struct {
		f   finished
		err error
	}
	done := make(chan result, 1)
	go func() {
		f, err := st.finish(ctx, "me", roundShards, nil, ids, nil, nil, roundKey{ids[0], ids[9]})
		done <- result{f, err}
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting int
		if err := st.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND query LIKE 'WITH lost AS%' || $1 || '%'`, outbox).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the row-by-row delete never waited for the locked row")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	res := <-done
	if res.err != nil {
		t.Fatal(res.err)
	}
	if res.f.deleted != 9 || res.f.leftToOthers != 0 {
		t.Errorf("finish deleted %d and left %d to others, want 9 and 0: the relay holds every shard, and the tenth was deleted by hand", res.f.deleted, res.f.leftToOthers)
	}
}
