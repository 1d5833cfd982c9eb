package relay

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/pgtest"
)

type execer interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

func claimSetup(t *testing.T) (context.Context, *store, string, func(execer, string) int64) {
	t.Helper()
	schema := pgtest.Schema(t)
	insertSQL := `INSERT INTO ` + pgx.Identifier{schema, "outbox"}.Sanitize() + ` (topic, key) VALUES ('t', $1::bytea) RETURNING id`
	insert := func(db execer, key string) int64 {
		t.Helper()
		var id int64
		if err := db.QueryRow(context.Background(), insertSQL, key).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	return context.Background(), newStore(pgtest.Pool(t), schema), schema, insert
}

// insertSized writes an event of key with a value of size zero bytes into
// schema's outbox and returns its id.
func insertSized(t *testing.T, st *store, schema, key string, size int) int64 {
	t.Helper()
	var id int64
	if err := st.pool.QueryRow(context.Background(), `INSERT INTO `+pgx.Identifier{schema, "outbox"}.Sanitize()+` (topic, key, value) VALUES ('t', $1::bytea, $2) RETURNING id`,
		key, make([]byte, size)).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

func everyShard() []int16 {
	out := make([]int16, NumShards)
	for i := range out {
		out[i] = int16(i)
	}
	return out
}

func claimedIDs(t *testing.T, st *store, shards []int16, limit int, blocked []keyBlock, excluded []int64) []int64 {
	t.Helper()
	events, err := st.claim(context.Background(), "me", shards, limit, blocked, excluded)
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]int64, len(events))
	for i := range events {
		ids[i] = events[i].id
	}
	return ids
}

// A read-ahead leaves the rounds in flight out by their exact ids. A row
// whose id lies inside an in-flight round's range but that was not in the
// round (its transaction committed after the round was read) must still be
// read before any later event of its key. An earlier version left out the
// whole id range and published the later event first (G3).
func TestClaimReadsALateCommittedRowInsideTheInFlightRange(t *testing.T) {
	t.Parallel()
	ctx, st, _, insert := claimSetup(t)
	pool := st.pool

	a := insert(pool, "a")
	late, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx)
	x := insert(late, "k") // not committed when the first round is read
	b := insert(pool, "b")
	c := insert(pool, "c")

	first := claimedIDs(t, st, everyShard(), 3, nil, nil)
	if want := []int64{a, b, c}; !slices.Equal(first, want) {
		t.Fatalf("first round read %v, want %v", first, want)
	}

	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	y := insert(pool, "k") // the key's next event, written after x committed

	ahead := claimedIDs(t, st, everyShard(), 3, nil, first)
	if want := []int64{x, y}; !slices.Equal(ahead, want) {
		t.Fatalf("read-ahead with round %v in flight read %v, want %v: event %d of key k would go out before event %d", first, ahead, want, y, x)
	}
}

// claim reads only the shards it is given, and leaves out a blocked key's
// events from its failed one on.
func TestClaimReadsOwnedShardsAndSkipsBlockedKeys(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	keys := []string{"k1", "k2", "k3", "k1", "k4", "k2", "k1"}
	ids := make([]int64, len(keys))
	for i, key := range keys {
		ids[i] = insert(st.pool, key)
	}
	shardOf := map[string]int16{}
	rows, _ := st.pool.Query(ctx, `SELECT convert_from(key, 'UTF8'), shard FROM `+pgx.Identifier{schema, "outbox"}.Sanitize())
	var key string
	var shard int16
	if _, err := pgx.ForEachRow(rows, []any{&key, &shard}, func() error { shardOf[key] = shard; return nil }); err != nil {
		t.Fatal(err)
	}
	owned := []int16{shardOf["k1"], shardOf["k2"]}
	slices.Sort(owned)
	owned = slices.Compact(owned)

	var want, wantBlocked []int64
	for i, key := range keys {
		if slices.Contains(owned, shardOf[key]) {
			want = append(want, ids[i])
			if !(key == "k1" && ids[i] >= ids[3]) {
				wantBlocked = append(wantBlocked, ids[i])
			}
		}
	}
	got := claimedIDs(t, st, owned, 100, nil, nil)
	if !slices.Equal(got, want) {
		t.Fatalf("owning shards %v (of k1 and k2) read %v, want %v", owned, got, want)
	}
	blocked := []keyBlock{{key: []byte("k1"), firstID: ids[3]}}
	got = claimedIDs(t, st, owned, 100, blocked, nil)
	if !slices.Equal(got, wantBlocked) {
		t.Fatalf("with k1 blocked from id %d read %v, want %v", ids[3], got, wantBlocked)
	}
}

// When the ids in flight are one run of consecutive integers, claim reads
// the index below and above the run: a late-committed row below it is still
// read first, and a row after it is read too.
func TestClaimAroundARunOfInFlightIDs(t *testing.T) {
	t.Parallel()
	ctx, st, _, insert := claimSetup(t)
	pool := st.pool

	late, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx)
	x := insert(late, "k") // not committed when the first round is read
	var first []int64
	for _, key := range []string{"a", "b", "c"} {
		first = append(first, insert(pool, key))
	}
	if got := claimedIDs(t, st, everyShard(), 3, nil, nil); !slices.Equal(got, first) {
		t.Fatalf("first round read %v, want %v", got, first)
	}
	if _, _, ok := oneRun(slices.Clone(first)); !ok {
		t.Fatalf("ids %v are not one run; the test needs them to be", first)
	}
	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	y := insert(pool, "k")
	z := insert(pool, "z")

	if got, want := claimedIDs(t, st, everyShard(), 10, nil, first), []int64{x, y, z}; !slices.Equal(got, want) {
		t.Fatalf("read-ahead around run %v read %v, want %v", first, got, want)
	}
	if got, want := claimedIDs(t, st, everyShard(), 2, []keyBlock{{key: []byte("k"), firstID: x}}, first), []int64{z}; !slices.Equal(got, want) {
		t.Fatalf("read-ahead around run %v with k blocked read %v, want %v", first, got, want)
	}
}

// finish deletes acknowledged events only on shards this relay still holds:
// all of them at once while it holds every shard of the round, row by row
// once one has changed hands (the new owner publishes those again).
func TestFinishDeletesOnlyOnShardsStillHeld(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	shardsTable := pgx.Identifier{schema, "relay_shards"}.Sanitize()
	outboxTable := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := st.pool.Exec(ctx, `UPDATE `+shardsTable+` SET owner = 'me', lease_until = now() + interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	shardOf := func(id int64) int16 {
		var s int16
		if err := st.pool.QueryRow(ctx, `SELECT shard FROM `+outboxTable+` WHERE id = $1`, id).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	pending := func() []int64 {
		rows, _ := st.pool.Query(ctx, `SELECT id FROM `+outboxTable+` ORDER BY id`)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}

	// Every shard of the round still held: everything acknowledged goes.
	var round []int64
	for _, key := range []string{"a", "b", "c"} {
		round = append(round, insert(st.pool, key))
	}
	f, err := st.finish(ctx, "me", everyShard(), nil, round, nil, nil, roundKey{round[0], round[len(round)-1]})
	if err != nil {
		t.Fatal(err)
	}
	if deleted := f.deleted; deleted != 3 || len(pending()) != 0 {
		t.Fatalf("holding every shard, finish deleted %d of 3 and left %v", deleted, pending())
	}

	// One shard taken by another relay mid-round: its event stays.
	round = round[:0]
	for _, key := range []string{"k1", "k2", "k3", "k4"} {
		round = append(round, insert(st.pool, key))
	}
	lost := shardOf(round[1])
	if _, err := st.pool.Exec(ctx, `UPDATE `+shardsTable+` SET owner = 'other' WHERE shard = $1`, lost); err != nil {
		t.Fatal(err)
	}
	var want []int64
	for _, id := range round {
		if shardOf(id) == lost {
			want = append(want, id)
		}
	}
	f, err = st.finish(ctx, "me", everyShard(), nil, round, nil, nil, roundKey{round[0], round[len(round)-1]})
	if err != nil {
		t.Fatal(err)
	}
	if got := pending(); !slices.Equal(got, want) || f.deleted != int64(len(round)-len(want)) || f.leftToOthers != int64(len(want)) {
		t.Fatalf("after losing shard %d, finish deleted %d and left %v (reported %d), want %v left", lost, f.deleted, got, f.leftToOthers, want)
	}
}

// Two rounds in flight may share a lowest id when a read-ahead reads again
// the failed first event of the round being recorded. The later round's
// in-flight record must outlive the earlier round's outcome, so a crash
// while it is published still charges its events.
func TestRoundRecordsSharingALowestIDAreForgottenByTheirOwnRound(t *testing.T) {
	t.Parallel()
	ctx, st, schema, _ := claimSetup(t)
	rounds := pgx.Identifier{schema, "relay_rounds"}.Sanitize()
	left := func() []roundKey {
		rows, _ := st.pool.Query(ctx, `SELECT lo, hi FROM `+rounds+` ORDER BY lo`)
		keys, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (roundKey, error) {
			var k roundKey
			return k, r.Scan(&k.lo, &k.hi)
		})
		if err != nil {
			t.Fatal(err)
		}
		return keys
	}
	earlier, later := roundKey{lo: 10, hi: 12}, roundKey{lo: 10, hi: 15}
	for _, k := range []roundKey{earlier, later} {
		if _, err := st.pool.Exec(ctx, st.markSQL, "me", k.lo, k.hi, everyShard()); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := st.finish(ctx, "me", everyShard(), nil, nil, nil, nil, earlier); err != nil {
		t.Fatal(err)
	}
	if got := left(); !slices.Equal(got, []roundKey{later}) {
		t.Fatalf("after the earlier round landed, relay_rounds holds %v, want %v", got, []roundKey{later})
	}
	if _, err := st.finish(ctx, "me", everyShard(), nil, nil, nil, nil, later); err != nil {
		t.Fatal(err)
	}
	if got := left(); len(got) != 0 {
		t.Fatalf("after both rounds landed, relay_rounds holds %v", got)
	}
}

// A round is bounded by bytes as well as by count, so a relay's memory does
// not grow with the size of events (1,000 events of 1 MB, twice with the
// read-ahead, were 2 GB): a claim returns the oldest events whose keys,
// values and headers fit in the bound, and an event larger than the bound
// alone, so that it can still be published.
func TestClaimBoundsARoundByBytes(t *testing.T) {
	t.Parallel()
	ctx, st, schema, _ := claimSetup(t)
	insert := func(key string, size int) int64 { return insertSized(t, st, schema, key, size) }
	big := insert("k0", 400_000) // larger than the bound
	var small []int64
	for i := range 6 {
		small = append(small, insert(fmt.Sprint("k", i%3), 100_000))
	}
	st.maxBytes = 250_000
	var sizes []int
	for _, c := range []struct {
		name     string
		shards   []int16
		blocked  []keyBlock
		excluded []int64
		want     []int64
	}{
		{"the oversized event goes alone", everyShard(), nil, nil, []int64{big}},
		{"then as many as fit", everyShard(), nil, []int64{big}, small[:2]},
		{"also as the read-ahead around a run", everyShard(), nil, []int64{big, small[0], small[1]}, small[2:4]},
		{"also per shard", everyShard()[:NumShards-1], nil, []int64{big}, nil},
		{"also with a blocked key", everyShard(), []keyBlock{{key: []byte("k1"), firstID: small[1]}}, []int64{big}, nil},
	} {
		events, err := st.claim(ctx, "me", c.shards, 100, c.blocked, c.excluded)
		if err != nil {
			t.Fatal(err)
		}
		ids, total := make([]int64, len(events)), 0
		for i, e := range events {
			ids[i] = e.id
			total += len(e.key) + len(e.value)
		}
		sizes = append(sizes, total)
		if c.want != nil && !slices.Equal(ids, c.want) {
			t.Errorf("%s: read %v, want %v", c.name, ids, c.want)
		}
		if len(events) > 1 && total > int(st.maxBytes) {
			t.Errorf("%s: read %d events of %d bytes in all, above the bound of %d", c.name, len(events), total, st.maxBytes)
		}
		if len(events) == 0 {
			t.Errorf("%s: read nothing", c.name)
		}
	}
	t.Logf("round sizes: %v", sizes)
}

// One relay's claim (every shard, the primary key) bounds a round by bytes
// without the window aggregate that spooled every row through PostgreSQL
// (guardBytes): it reads the keys, values and headers of events within a
// round's share of the bound, withholds larger ones, and cuts the round on
// the client. A withheld event the bound keeps is read again exactly, with
// its value, and the next claims are exact for a while. Rounds are the
// same as boundBytes makes them.
func TestGuardedClaimBoundsBytesAndReadsWithheldEventsExactly(t *testing.T) {
	t.Parallel()
	ctx, st, schema, _ := claimSetup(t)
	small, big := insertGuarded(t, st, schema)
	st.maxBytes = 20_000 // a share of 2,000 bytes in a round of 10
	stmts := st.claimStatements(everyShard(), 10, nil, nil)
	if len(stmts) != 1 || stmts[0].exact == nil || strings.Contains(stmts[0].sql, "OVER") {
		t.Fatalf("one relay's claim is not guarded: %+v", stmts)
	}
	checkGuardedClaims(t, st, small, big, func(excluded []int64) ([]pendingEvent, error) {
		return st.claim(ctx, "me", everyShard(), 10, nil, excluded)
	}, 0)
}

// insertGuarded writes checkGuardedClaims' events into schema's outbox.
func insertGuarded(t *testing.T, st *store, schema string) (small []int64, big int64) {
	t.Helper()
	insert := func(key string, size int) int64 { return insertSized(t, st, schema, key, size) }
	for i := range 3 {
		small = append(small, insert(fmt.Sprint("k", i), 100))
	}
	big = insert("k0", 30_000)                                    // above the bound
	small = append(small, insert("k1", 100), insert("k2", 5_000)) // the second above a round's share
	return small, big
}

// checkGuardedClaims claims three rounds of 10 (claim leaves out the ids it
// is given) with a byte bound of 20,000 (a share of 2,000 a round) from
// small (three events of 100 bytes, then one of 100 and one of 5,000) and
// big (30,000 bytes, after the first three): the first round is cut on the
// client before big, the second is big alone, read again exactly, and the
// third is read exactly too. A claim of one guarded statement reads it
// again by itself; one of several (a floor read) claims again whole, which
// spends one of the exact claims to go: redo.
func checkGuardedClaims(t *testing.T, st *store, small []int64, big int64, claim func(excluded []int64) ([]pendingEvent, error), redo int) {
	t.Helper()
	for _, c := range []struct {
		name      string
		excluded  []int64
		want      []int64
		wantSizes []int
		exactOff  int
	}{
		{"small events, cut before one above the bound, on the client", nil, small[:3], []int{100, 100, 100}, 0},
		{"the event above the bound alone, read again exactly", small[:3], []int64{big}, []int{30_000}, claimExactOff - redo},
		{"then exactly for a while", append(slices.Clone(small[:3]), big), small[3:], []int{100, 5_000}, claimExactOff - 1 - redo},
	} {
		events, err := claim(c.excluded)
		if err != nil {
			t.Fatal(err)
		}
		ids, sizes := make([]int64, len(events)), make([]int, len(events))
		for i, e := range events {
			ids[i], sizes[i] = e.id, len(e.value)
			if e.withheld || len(e.key) == 0 {
				t.Errorf("%s: event %d came without its key or value", c.name, e.id)
			}
		}
		if !slices.Equal(ids, c.want) || !slices.Equal(sizes, c.wantSizes) {
			t.Errorf("%s: read %v of sizes %v, want %v of sizes %v", c.name, ids, sizes, c.want, c.wantSizes)
		}
		if st.exactOff != c.exactOff {
			t.Errorf("%s: %d exact claims to go, want %d", c.name, st.exactOff, c.exactOff)
		}
	}
}

// A claim copies keys and values out of the driver's buffers into slabs
// shared by the round: a NULL key or value stays nil (a keyless event, a
// tombstone), an empty one stays empty, a large one is whole, and no two
// events share bytes.
func TestClaimKeepsNullEmptyAndLargeKeysAndValuesApart(t *testing.T) {
	t.Parallel()
	ctx, st, schema, _ := claimSetup(t)
	table := pgx.Identifier{schema, "outbox"}.Sanitize()
	large := bytes.Repeat([]byte("v"), 40_000)
	rows := []struct{ key, value []byte }{
		{nil, nil}, {[]byte{}, []byte{}}, {[]byte("k1"), large}, {[]byte("k2"), []byte("v2")},
	}
	for _, r := range rows {
		if _, err := st.pool.Exec(ctx, `INSERT INTO `+table+` (topic, key, value) VALUES ('t', $1, $2)`, r.key, r.value); err != nil {
			t.Fatal(err)
		}
	}
	events, err := st.claim(ctx, "me", everyShard(), 10, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(events) != len(rows) {
		t.Fatalf("read %d events, want %d", len(events), len(rows))
	}
	for i, r := range rows {
		e := events[i]
		if (e.key == nil) != (r.key == nil) || (e.value == nil) != (r.value == nil) || !bytes.Equal(e.key, r.key) || !bytes.Equal(e.value, r.value) {
			t.Errorf("event %d: key %q (nil %v) value of %d bytes (nil %v), want key %q (nil %v) value of %d bytes (nil %v)",
				i, e.key, e.key == nil, len(e.value), e.value == nil, r.key, r.key == nil, len(r.value), r.value == nil)
		}
	}
	events[3].key = append(events[3].key, 'x') // capped: must not write into the bytes after it
	if string(events[3].value) != "v2" {
		t.Errorf("appending to an event's key changed its value to %q", events[3].value)
	}
}

// finish deletes exactly the acknowledged events: not a row whose id lies
// between two of them (a late commit the round did not read, an event
// left pending), whatever the order of the ids it is given and if one
// comes twice.
func TestFinishDeletesExactlyTheAcknowledgedIDs(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	outboxTable := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := st.pool.Exec(ctx, `UPDATE `+pgx.Identifier{schema, "relay_shards"}.Sanitize()+` SET owner = 'me', lease_until = now() + interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	ids := make([]int64, 12)
	for i := range ids {
		ids[i] = insert(st.pool, fmt.Sprintf("k%d", i))
	}
	pending := func() []int64 {
		rows, _ := st.pool.Query(ctx, `SELECT id FROM `+outboxTable+` ORDER BY id`)
		got, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	for _, c := range []struct {
		name  string
		acked []int64
		left  []int64
	}{
		{"a run", []int64{ids[0], ids[1], ids[2]}, []int64{ids[3], ids[4], ids[5], ids[6], ids[7], ids[8], ids[9], ids[10], ids[11]}},
		{"runs with gaps", []int64{ids[4], ids[6], ids[7]}, []int64{ids[3], ids[5], ids[8], ids[9], ids[10], ids[11]}},
		{"out of order, one twice", []int64{ids[10], ids[8], ids[9], ids[9], ids[3]}, []int64{ids[5], ids[11]}},
		{"one", []int64{ids[11]}, []int64{ids[5]}},
	} {
		round := roundKey{slices.Min(c.acked), slices.Max(c.acked)}
		f, err := st.finish(ctx, "me", everyShard(), nil, c.acked, nil, nil, round)
		deleted := f.deleted
		if err != nil {
			t.Fatal(err)
		}
		if got := pending(); !slices.Equal(got, c.left) {
			t.Fatalf("%s: finish(%v) left %v, want %v", c.name, c.acked, got, c.left)
		}
		want := int64(len(c.acked))
		if slices.Contains(c.acked, ids[9]) {
			want-- // given twice
		}
		if deleted != want {
			t.Fatalf("%s: finish reported %d deleted, want %d", c.name, deleted, want)
		}
	}
}

// The delete of a round whose acknowledged ids are one run reads that
// range of the primary key, under the generic plan too, estimated far
// below jit_above_cost (100,000; a join with unnest of several runs was
// estimated at 170,000 with 1M rows and JIT-compiled), and touches a few
// index pages besides the rows, where "= ANY" probed the index once per id
// (three buffers each).
func TestFinishDeletesARunByARangeOfThePrimaryKey(t *testing.T) {
	if testing.Short() {
		t.Skip("inserts 200k rows; skipped with -short")
	}
	t.Parallel()
	ctx, st, schema, _ := claimSetup(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 'bench', ('key-' || (g % 1000))::bytea, repeat('x', 256)::bytea FROM generate_series(1, 200000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := st.pool.Exec(ctx, `VACUUM ANALYZE `+outbox); err != nil {
		t.Fatal(err)
	}
	if _, err := st.pool.Exec(ctx, `UPDATE `+pgx.Identifier{schema, "relay_shards"}.Sanitize()+` SET owner = 'me', lease_until = now() + interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	var first int64
	if err := st.pool.QueryRow(ctx, `SELECT min(id) + 100000 FROM `+outbox).Scan(&first); err != nil {
		t.Fatal(err)
	}
	plan := explainGeneric(t, statement{sql: st.deleteRunSQL, args: []any{first, first + 999, "me", everyShard()}})
	if !strings.Contains(plan, "Index Scan using outbox_pkey") || strings.Contains(plan, "JIT") || !strings.Contains(plan, "rows=1000 loops=1") {
		t.Fatalf("the delete of a run does not read one range of the primary key:\n%s", plan)
	}
	cost := regexp.MustCompile(`^Delete on outbox o  \(cost=[0-9.]+\.\.([0-9]+)`).FindStringSubmatch(plan)
	if cost == nil {
		t.Fatalf("no cost in the plan:\n%s", plan)
	}
	if c, _ := strconv.Atoi(cost[1]); c > 2_000 {
		t.Fatalf("the delete of a run is estimated at %d with 200k rows (JIT from 100,000):\n%s", c, plan)
	}
	if n := topBuffers(plan); n > 1_100 {
		t.Fatalf("the delete of a run of 1,000 touched %d buffers:\n%s", n, plan)
	}
	// The round's other statements run generic plans too (finish forces
	// them): each finds its rows through the primary key, not a scan.
	ids := make([]int64, 1000)
	errs := make([]string, len(ids))
	runs := make([]int16, len(ids))
	charges := make([]bool, len(ids))
	for i := range ids {
		ids[i], errs[i], charges[i] = first+int64(2*i), "failed", i%2 == 0
	}
	for name, stmt := range map[string]statement{
		"delete by id":  {sql: st.deleteSQL, args: []any{ids, "me", everyShard()}},
		"failure":       {sql: st.failSQL, args: []any{ids, errs, runs, charges}},
		"dead letters":  {sql: st.deadSQL, args: []any{ids, errs, "me", "token", make([]int64, NumShards)}},
		"delete by row": {sql: st.deleteOwnedSQL, args: []any{ids, "me"}},
	} {
		plan := explainGeneric(t, stmt)
		if !strings.Contains(plan, "using outbox_pkey") || strings.Contains(plan, "Seq Scan on outbox") || strings.Contains(plan, "JIT") {
			t.Errorf("the %s statement's generic plan does not go through the primary key:\n%s", name, plan)
		}
	}
}

func TestLongestRun(t *testing.T) {
	for _, c := range []struct {
		ids    []int64
		lo, hi int64
		rest   []int64
	}{
		{nil, 0, -1, nil},
		{[]int64{7}, 7, 7, []int64{}},
		{[]int64{7, 8, 9}, 7, 9, []int64{}},
		{[]int64{3, 7, 8, 9, 20}, 7, 9, []int64{3, 20}},
		{[]int64{1, 2, 5, 6}, 1, 2, []int64{5, 6}}, // the first of two as long
		{[]int64{8, 7}, 8, 8, []int64{7}},
		{[]int64{7, 7, 8}, 7, 8, []int64{7}},
	} {
		lo, hi, rest := longestRun(c.ids)
		if lo != c.lo || hi != c.hi || !slices.Equal(rest, c.rest) {
			t.Errorf("longestRun(%v) = %d, %d, %v; want %d, %d, %v", c.ids, lo, hi, rest, c.lo, c.hi, c.rest)
		}
	}
}

// A round read beside a blocked key is one run of ids but for a few: the
// run is deleted by a range, the others by id, and nothing else goes (not
// the row inside the round's span that it did not read).
func TestFinishDeletesTheLongestRunByARangeAndTheRestByID(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	if _, err := st.pool.Exec(ctx, `UPDATE `+pgx.Identifier{schema, "relay_shards"}.Sanitize()+` SET owner = 'me', lease_until = now() + interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	var ids []int64
	for i := range 200 {
		ids = append(ids, insert(st.pool, fmt.Sprint("k", i%7)))
	}
	acked := append([]int64{ids[5]}, ids[10:110]...)
	acked = append(acked, ids[150])
	if lo, hi, rest := longestRun(acked); hi-lo+1 < minDeleteRun || len(rest) != 2 {
		t.Fatalf("the round is not one long run and two more: %d..%d, %v", lo, hi, rest)
	}
	f, err := st.finish(ctx, "me", everyShard(), nil, acked, nil, nil, roundKey{ids[5], ids[150]})
	deleted := f.deleted
	if err != nil {
		t.Fatal(err)
	}
	if deleted != int64(len(acked)) {
		t.Errorf("finish reported %d deleted, want %d", deleted, len(acked))
	}
	rows, _ := st.pool.Query(ctx, `SELECT id FROM `+pgx.Identifier{schema, "outbox"}.Sanitize()+` ORDER BY id`)
	left, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	var want []int64
	for _, id := range ids {
		if !slices.Contains(acked, id) {
			want = append(want, id)
		}
	}
	if !slices.Equal(left, want) {
		t.Errorf("finish left %v, want %v", left, want)
	}
}

// Beside a blocked key, the floor read is guarded as one relay's claim is
// (its values withheld above a round's share, no running sum): the claim
// bounds the round the floor read and the blocked shard's read make
// together, and claims again exactly when the bound keeps an event the
// floor read withheld.
func TestGuardedFloorReadBesideABlockedKeyBoundsBytesAndReadsWithheldEventsExactly(t *testing.T) {
	t.Parallel()
	ctx, st, schema, _ := claimSetup(t)
	insert := func(key string, size int) int64 { return insertSized(t, st, schema, key, size) }
	stuckFirst := insert("stuck", 100)
	insert("stuck", 100)
	small, big := insertGuarded(t, st, schema)
	insert("stuck", 100)
	st.maxBytes = 20_000 // a share of 2,000 bytes in a round of 10
	blocked := []keyBlock{{key: []byte("stuck"), firstID: stuckFirst}}
	st.lastFull = true // a backlog draining: the free shards are read from the floor
	stmts := st.claimStatements(everyShard(), 10, blocked, nil)
	var floor *statement
	for i := range stmts {
		if stmts[i].floor {
			floor = &stmts[i]
		}
	}
	if floor == nil || !floor.guarded || strings.Contains(floor.sql, "OVER") {
		t.Fatalf("the floor read beside a blocked key is not guarded: %+v", stmts)
	}
	checkGuardedClaims(t, st, small, big, func(excluded []int64) ([]pendingEvent, error) {
		st.lastFull = true
		return st.claim(ctx, "me", everyShard(), 10, blocked, excluded)
	}, 1)
}

func TestSortByID(t *testing.T) {
	ids := func(es []pendingEvent) []int64 {
		out := make([]int64, len(es))
		for i := range es {
			out[i] = es[i].id
		}
		return out
	}
	events := func(ids ...int64) []pendingEvent {
		out := make([]pendingEvent, len(ids))
		for i, id := range ids {
			out[i] = pendingEvent{id: id, size: id * 10}
		}
		return out
	}
	for _, in := range [][]int64{
		nil,
		{1},
		{1, 2, 3},
		{1, 5, 9, 2, 3, 10},
		{4, 8, 1, 9, 2, 3, 7, 0},
		{9, 8, 7, 6, 5, 4, 3, 2, 1}, // more runs than merged: sorted
	} {
		got := sortByID(events(in...))
		want := slices.Sorted(slices.Values(in))
		if !slices.Equal(ids(got), want) {
			t.Errorf("sortByID(%v) = %v, want %v", in, ids(got), want)
		}
		for _, e := range got {
			if e.size != e.id*10 {
				t.Errorf("sortByID(%v): event %d lost its fields", in, e.id)
			}
		}
	}
}

// So are the reads of a relay that owns some of the shards, not all: a
// few (merged in id order) or many (by their shares).
func TestGuardedShardsReadBoundsBytesAndReadsWithheldEventsExactly(t *testing.T) {
	for _, many := range []bool{false, true} {
		t.Run(fmt.Sprint("many shards ", many), func(t *testing.T) {
			t.Parallel()
			testGuardedShardsRead(t, many)
		})
	}
}

func testGuardedShardsRead(t *testing.T, many bool) {
	ctx, st, schema, _ := claimSetup(t)
	var owned []int16
	for _, k := range []string{"k0", "k1", "k2"} {
		if sh := int16(keyHash([]byte(k))[0]); !slices.Contains(owned, sh) {
			owned = append(owned, sh)
		}
	}
	for sh := int16(0); many && len(owned) < NumShards/2; sh++ {
		if !slices.Contains(owned, sh) {
			owned = append(owned, sh)
		}
	}
	slices.Sort(owned)
	small, big := insertGuarded(t, st, schema)
	st.maxBytes = 20_000 // a share of 2,000 bytes in a round of 10
	stmts := st.claimStatements(owned, 10, nil, nil)
	if len(stmts) != 1 || !stmts[0].guarded || strings.Contains(stmts[0].sql, "OVER") {
		t.Fatalf("the read of some of the shards is not guarded: %+v", stmts)
	}
	checkGuardedClaims(t, st, small, big, func(excluded []int64) ([]pendingEvent, error) {
		return st.claim(ctx, "me", owned, 10, nil, excluded)
	}, 1)
}
