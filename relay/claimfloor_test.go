package relay

import (
	"context"
	"crypto/sha256"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// claimFloorCase sets up a store whose claims read the free shards from
// their floor (claimFloorQuery) beside a blocked key with the oldest
// events, and returns it, the outbox's name and the blocked key.
func claimFloorCase(t *testing.T) (context.Context, *store, string, func(execer, string) int64, []keyBlock) {
	t.Helper()
	ctx, st, schema, insert := claimSetup(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	stuckFirst := insert(st.pool, "stuck")
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', 'stuck'::bytea FROM generate_series(1, 300)`); err != nil {
		t.Fatal(err)
	}
	st.lastFull = true
	return ctx, st, outbox, insert, []keyBlock{{key: []byte("stuck"), firstID: stuckFirst}}
}

// oldestFree returns the ids of the oldest n pending events not of the
// stuck key and not excluded.
func oldestFree(t *testing.T, st *store, outbox string, n int, excluded []int64) []int64 {
	t.Helper()
	return oldestFreeIn(t, st, outbox, n, excluded, everyShard())
}

// oldestFreeIn is oldestFree among the events of shards.
func oldestFreeIn(t *testing.T, st *store, outbox string, n int, excluded []int64, shards []int16) []int64 {
	t.Helper()
	rows, _ := st.pool.Query(context.Background(), `SELECT id FROM `+outbox+`
WHERE key <> 'stuck' AND id <> ALL($1::bigint[]) AND shard = ANY($3) ORDER BY id LIMIT $2`, append([]int64{}, excluded...), n, shards)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// A floor read after the first of a run starts its descents below a base,
// the lowest id the earlier floor reads read. A row below the base that
// committed late (its id handed out before the rounds that set the base
// were read) must still be read, before the later events of its key: the
// base only says where each shard's descent may stop, never where the read
// starts.
func TestClaimFromTheFloorReadsALateCommitBelowItsBase(t *testing.T) {
	t.Parallel()
	ctx, st, outbox, insert, blocked := claimFloorCase(t)
	late, err := st.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx)
	lateID := insert(late, "late-key")
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ('k' || (g % 40))::bytea FROM generate_series(1, 400) g`); err != nil {
		t.Fatal(err)
	}
	after := insert(st.pool, "late-key") // the late key's next event, committed first
	deleteIDs := func(ids []int64) {
		if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, ids); err != nil {
			t.Fatal(err)
		}
	}
	// Two floor reads: the second has a base above the late row's id.
	for round := range 2 {
		got := claimedIDs(t, st, everyShard(), 100, blocked, nil)
		if want := oldestFree(t, st, outbox, 100, nil); !slices.Equal(got, want) {
			t.Fatalf("claim %d read %v, want %v", round, got, want)
		}
		deleteIDs(got)
	}
	if base := st.floorBase(); base <= lateID {
		t.Fatalf("floor base %d, want one above the late row %d for this test", base, lateID)
	}
	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for {
		got := claimedIDs(t, st, everyShard(), 100, blocked, nil)
		if want := oldestFree(t, st, outbox, 100, nil); !slices.Equal(got, want) {
			t.Fatalf("claim after the late commit read %v, want %v", got, want)
		}
		if slices.Contains(got, after) {
			if !slices.Contains(got, lateID) {
				t.Fatalf("claim read the late key's event %d without its earlier one %d", after, lateID)
			}
			return
		}
		if slices.Contains(got, lateID) {
			return
		}
		if len(got) == 0 {
			t.Fatal("the late row was never read")
		}
		deleteIDs(got)
	}
}

// A floor read steps over the runs of ids in flight (a read-ahead's
// rounds) instead of fetching their rows; the ids between two runs that
// are not in flight (a row that committed after its neighbours were read)
// are still read, in id order with the rest.
func TestClaimFromTheFloorStepsOverTheRoundsInFlightButNotBetweenThem(t *testing.T) {
	t.Parallel()
	ctx, st, outbox, insert, blocked := claimFloorCase(t)
	// 40 keys, and one in the blocked key's shard (read by key hash, with
	// the runs in flight left out there too): the late row's.
	shared := keysInShard(sha256.Sum256([]byte("stuck"))[0], 1, "stuck")[0]
	keys := []string{shared}
	for i := range 40 {
		keys = append(keys, fmt.Sprintf("k%d", i))
	}
	fill := func() {
		if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ($1::text[])[1 + g % 41]::bytea FROM generate_series(1, 400) g`, keys); err != nil {
			t.Fatal(err)
		}
	}
	fill()
	late, err := st.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx)
	lateID := insert(late, shared)
	fill()
	free := oldestFree(t, st, outbox, 1000, nil)
	// In flight: the 150 oldest free events, a run of 3 ids, and 200 from
	// just past the late row (below and above it: its neighbours).
	var excluded []int64
	excluded = append(excluded, free[:150]...)
	excluded = append(excluded, free[200:203]...)
	at := slices.Index(free, lateID+1)
	if at < 0 {
		t.Fatalf("no free event right after the late row %d", lateID)
	}
	excluded = append(excluded, free[at-100:at]...) // up to the late row, not including it
	excluded = append(excluded, free[at:at+100]...)
	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if runs, _ := skipRuns(slices.Clone(excluded)); len(runs) < 2 {
		t.Fatalf("runs stepped over %v, want at least two for this test", runs)
	}
	stmts := st.claimStatements(everyShard(), 100, blocked, slices.Clone(excluded))
	if !stmts[0].floor {
		t.Fatal("the free shards are not read from their floor")
	}
	got := claimedIDs(t, st, everyShard(), 100, blocked, slices.Clone(excluded))
	want := oldestFree(t, st, outbox, 100, excluded)
	if !slices.Equal(got, want) {
		t.Fatalf("claim read %v, want %v", got, want)
	}
	for _, id := range got {
		if slices.Contains(excluded, id) {
			t.Fatalf("claim read %d, in flight", id)
		}
	}
	// The late row lies between the runs before it and after it: read
	// once the claims get there (each claim's rows are taken as read).
	for !slices.Contains(got, lateID) {
		excluded = append(excluded, got...)
		got = claimedIDs(t, st, everyShard(), 100, blocked, slices.Clone(excluded))
		if want := oldestFree(t, st, outbox, 100, excluded); !slices.Equal(got, want) {
			t.Fatalf("claim read %v, want %v", got, want)
		}
		if len(got) == 0 {
			t.Fatalf("the late row %d between two runs in flight was never read", lateID)
		}
	}
}

// Whatever the base a relay carries (set while it owned other rows: a
// shard handed over by a relay that died, or a blocked key released, left
// events far below it), a floor read reads the oldest pending events.
func TestClaimFromTheFloorReadsTheOldestEventsWhateverItsBase(t *testing.T) {
	t.Parallel()
	ctx, st, outbox, _, blocked := claimFloorCase(t)
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ('k' || (g % 40))::bytea FROM generate_series(1, 300) g`); err != nil {
		t.Fatal(err)
	}
	all := oldestFree(t, st, outbox, 300, nil)
	for _, base := range []int64{all[0], all[1], all[150], all[299], all[299] + 1000} {
		st.floorFrom = []int64{base}
		st.lastFull = true
		got := claimedIDs(t, st, everyShard(), 100, blocked, nil)
		if !slices.Equal(got, all[:100]) {
			t.Fatalf("base %d: claim read %v, want %v", base, got, all[:100])
		}
	}
}

// A floor read short of the round because the backlog ends there (nothing
// free above what it read) keeps what it read: the claim does not read the
// shares as well, as it does for a read stopped by its walk's bound
// (TestClaimReadsByTheFreeShardsSharesWhereABlockedKeyIsDenseAboveTheFloor).
func TestClaimFromTheFloorAtTheEndOfABacklogKeepsItsShortRead(t *testing.T) {
	t.Parallel()
	ctx, st, outbox, _, blocked := claimFloorCase(t)
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ('k' || (g % 40))::bytea FROM generate_series(1, 60) g`); err != nil {
		t.Fatal(err)
	}
	inFlight := oldestFree(t, st, outbox, 10, nil)
	got := claimedIDs(t, st, everyShard(), 100, blocked, slices.Clone(inFlight))
	if want := oldestFree(t, st, outbox, 100, inFlight); !slices.Equal(got, want) || len(got) != 50 {
		t.Fatalf("claim read %v, want the 50 events left %v", got, want)
	}
	if st.floorOff != 0 {
		t.Error("a floor read short at the end of the backlog was taken for one stopped by its walk's bound")
	}
}

// A key that fails after claims through the primary key (nothing blocked
// yet: its oldest events were read there, and the floor proof those claims
// carry starts among them) must not leave the floor reads that follow
// starting at those ids: they would walk the blocked key's events, come
// short of the round and send the next claims to the free shards' shares
// (claimFloorOff of them), a key at a time. The stuck-key benchmark's other
// keys drained at 0.25x instead of 0.40x.
func TestClaimFromTheFloorAfterClaimsThroughThePrimaryKeyStartsPastTheBlockedKey(t *testing.T) {
	t.Parallel()
	ctx, st, outbox, _, blocked := claimFloorCase(t)
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ('k' || (g % 40))::bytea FROM generate_series(1, 600) g`); err != nil {
		t.Fatal(err)
	}
	// The stuck key's oldest events, read and failed claim after claim
	// before the relay holds the key back.
	for range 3 * claimProofEvery {
		st.lastFull = true
		claimedIDs(t, st, everyShard(), 100, nil, nil)
	}
	for round := range 3 {
		want := oldestFree(t, st, outbox, 100, nil)
		st.lastFull = true
		got := claimedIDs(t, st, everyShard(), 100, blocked, nil)
		if !slices.Equal(got, want) {
			t.Fatalf("round %d: claim read %v, want %v", round, got, want)
		}
		if st.floorOff != 0 {
			t.Fatalf("round %d: the floor read walked the blocked key's events from where the claims through the primary key read, came short and turned to the shares", round)
		}
		if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, got); err != nil {
			t.Fatal(err)
		}
	}
}

// The floor reads that follow claims through the primary key (a key about
// to be blocked among their oldest events) prove their floor within a few
// claims. The floor proof the claims through the primary key had started
// is dropped with their history (floorShape), and so is the wait it set
// before the next may start: the floor reads used to descend all 255 free
// shards for claimProofEvery claims more (0.6-6 ms a claim, at the start
// of every drain beside a stuck key). The first floor read starts the next
// proof, its C that read's own floor: the second confirms it (the first
// floor reads are the costliest of the episode, each planned afresh on
// every pool connection that meets them).
func TestFloorReadsAfterClaimsThroughThePrimaryKeyProveTheirFloorSoon(t *testing.T) {
	t.Parallel()
	ctx, st, outbox, _, blocked := claimFloorCase(t)
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ('k' || (g % 40))::bytea FROM generate_series(1, 2000) g`); err != nil {
		t.Fatal(err)
	}
	// The stuck key's oldest events, read through the primary key twice
	// (a round and its read-ahead) before it fails: a proof starts.
	for range 2 {
		st.lastFull = true
		claimedIDs(t, st, everyShard(), 100, nil, nil)
	}
	if st.proving == nil && st.proof.below == 0 {
		t.Fatal("the claims through the primary key started no floor proof")
	}
	// One to set the base and start, one to confirm: each round lands
	// before the next claim here (TestAFloorProofConfirmedBesideRoundsNotLanded...
	// has rounds landing late).
	floorProofWithin(t, st, 2, "no transaction holding an id", func() {
		st.lastFull = true
		got := claimedIDs(t, st, everyShard(), 100, blocked, nil)
		if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, got); err != nil {
			t.Fatal(err)
		}
	})
	// With the proof the claim reads from its C: through the primary key
	// (a held read, claimheld_test.go), or the floor read descending no
	// shard.
	st.lastFull = true
	if stmt := st.claimStatements(everyShard(), 100, blocked, nil)[0]; stmt.held == nil {
		if descend := stmt.args[0].([]int16); len(descend) != 0 {
			t.Fatalf("with the floor proof, the floor read still descends %d shards", len(descend))
		}
	}
}

// Whatever the runs of ids in flight it steps over (none, a few, every
// slot taken, more runs than slots), a floor read reads exactly the oldest
// events that are neither excluded nor the blocked key's.
func TestClaimFromTheFloorReadsTheSameWhateverTheRunsInFlight(t *testing.T) {
	t.Parallel()
	ctx, st, outbox, _, blocked := claimFloorCase(t)
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ('k' || (g % 40))::bytea FROM generate_series(1, 2000) g`); err != nil {
		t.Fatal(err)
	}
	all := oldestFree(t, st, outbox, 2000, nil)
	for _, runs := range []int{0, 1, 3, claimFloorSkips, claimFloorSkips + 5} {
		// runs of 20 ids in flight, 30 apart, and a few single ids
		var excluded []int64
		for r := range runs {
			for i := range 20 {
				excluded = append(excluded, all[50*r+i])
			}
		}
		excluded = append(excluded, all[1950], all[1960])
		if got, _ := skipRuns(slices.Clone(excluded)); len(got) != min(runs, claimFloorSkips) {
			t.Fatalf("%d runs in flight make %d runs to step over", runs, len(got))
		}
		st.floorFrom = []int64{all[0]}
		st.lastFull = true
		got := claimedIDs(t, st, everyShard(), 500, blocked, excluded)
		want := oldestFree(t, st, outbox, 500, excluded)
		if !slices.Equal(got, want) {
			t.Fatalf("%d runs in flight: claim read %v, want %v", runs, got, want)
		}
		if len(st.floorFrom) == 0 {
			t.Fatalf("%d runs in flight: the claim was not a floor read", runs)
		}
	}
}

// Beside a blocked key, the other keys of its shard are read with the
// free shards, in id order: a round is the oldest pending events of every
// key but the blocked one, whatever the number of other keys the shard
// holds and their events. A claim that read that shard only by key hash, a
// few dozen events a claim, left holes in each round where that shard's
// unread events lay, took events of its other keys from far ahead, and
// split the rounds into runs the delete went through id by id (the
// stuck-key benchmark's rounds spanned 4,800 ids for 1,000 events).
func TestClaimFromTheFloorReadsTheBlockedShardsOtherKeysInIDOrder(t *testing.T) {
	t.Parallel()
	ctx, st, outbox, _, blocked := claimFloorCase(t)
	keys := keysInShard(sha256.Sum256([]byte("stuck"))[0], 4, "stuck")
	for i := range 40 {
		keys = append(keys, fmt.Sprintf("k%d", i))
	}
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ($1::text[])[1 + g % 44]::bytea FROM generate_series(1, 3000) g`, keys); err != nil {
		t.Fatal(err)
	}
	// A relay's rounds: each claim leaves out the round in flight (its
	// read-ahead), and the round before it is deleted.
	// The first floor read has no base yet to read the blocked shard
	// below (claimBlockedQuery): its round is a prefix of each key's
	// events, not necessarily the oldest events. (Reading by key hash
	// after it, below the first event it read, made it the oldest too, at
	// one more round trip and no gain in the stuck-key benchmark.)
	var inFlight []int64
	for round := 0; ; round++ {
		want := oldestFree(t, st, outbox, 100, inFlight)
		pending := pendingByKey(t, st, outbox, inFlight)
		st.lastFull = true
		got := claimedIDs(t, st, everyShard(), 100, blocked, slices.Clone(inFlight))
		if round > 0 && !slices.Equal(got, want) {
			t.Fatalf("round %d: claim read %v, want %v", round, got, want)
		}
		if len(got) > 0 && len(st.floorFrom) == 0 {
			t.Fatalf("round %d was not a floor read", round)
		}
		taken := map[string][]int64{}
		for _, id := range got {
			taken[pending.key[id]] = append(taken[pending.key[id]], id)
		}
		for k, ids := range taken {
			if all := pending.ids[k]; len(ids) > len(all) || !slices.Equal(ids, all[:len(ids)]) {
				t.Fatalf("round %d took %v of key %q, want a prefix of its pending %v", round, ids, k, all)
			}
		}
		if len(got) == 0 {
			break
		}
		if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, inFlight); err != nil {
			t.Fatal(err)
		}
		inFlight = got
	}
}

// keyedPending is the pending events, in id order, of every key but the
// stuck one: each key's ids, and each id's key.
type keyedPending struct {
	ids map[string][]int64
	key map[int64]string
}

func pendingByKey(t *testing.T, st *store, outbox string, excluded []int64) keyedPending {
	t.Helper()
	rows, _ := st.pool.Query(context.Background(), `SELECT id, convert_from(key, 'UTF8') FROM `+outbox+`
WHERE key <> 'stuck' AND id <> ALL($1::bigint[]) ORDER BY id`, append([]int64{}, excluded...))
	p := keyedPending{ids: map[string][]int64{}, key: map[int64]string{}}
	var id int64
	var key string
	if _, err := pgx.ForEachRow(rows, []any{&id, &key}, func() error {
		p.ids[key] = append(p.ids[key], id)
		p.key[id] = key
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return p
}

// floorBranches covers every id outside the runs exactly once, in
// claimFloorSkips+1 branches whatever the runs, the unused ones empty.
func TestFloorBranchesCoverEveryIDOutsideTheRuns(t *testing.T) {
	t.Parallel()
	for _, runs := range [][][2]int64{
		nil,
		{{10, 20}},
		{{10, 20}, {21, 30}}, // adjacent: no range between them
		{{math.MinInt64, 5}, {7, 7}, {100, math.MaxInt64}},
		{{1, 2}, {4, 5}, {7, 8}, {10, 11}},
	} {
		got := floorBranches(runs)
		if len(got) != claimFloorSkips+1 {
			t.Fatalf("runs %v: %d branches, want %d", runs, len(got), claimFloorSkips+1)
		}
		for _, id := range []int64{math.MinInt64, math.MinInt64 + 1, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 20, 21, 25, 30, 31, 99, 100, 101, math.MaxInt64 - 1, math.MaxInt64} {
			inRun := false
			for _, r := range runs {
				inRun = inRun || r[0] <= id && id <= r[1]
			}
			n := 0
			for _, b := range got {
				if b[0] <= id && id <= b[1] {
					n++
				}
			}
			if want := map[bool]int{true: 0, false: 1}[inRun]; n != want {
				t.Fatalf("runs %v, branches %v: id %d in %d branches, want %d", runs, got, id, n, want)
			}
		}
	}
}

// A floor proof started by the first floor read of a run (its C that read's
// own floor) is confirmed by the second, while the rounds read before the
// key was blocked may not have landed: one relay owning every shard reads
// ahead without waiting for the last round's deletes (Relay.readAheadWaits),
// so a claim leaves out the round in flight and the one being recorded, and
// the latter's delete commits after the claim. Their shards, rows still
// pending below C, are left out of the first confirm; a second confirm of
// the same C, a floor read on, takes them in (rows below C are only deleted
// from then on), where they used to be descended until the next proof,
// claimProofEvery floor reads on.
func TestAFloorProofConfirmedBesideRoundsNotLandedTakesTheirShardsInOneReadOn(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	stuck := insert(st.pool, "stuck")
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ('k' || g)::bytea FROM generate_series(1, 8000) g`); err != nil {
		t.Fatal(err)
	}
	stuckShard := int16(keyHash([]byte("stuck"))[0])
	free := slices.DeleteFunc(everyShard(), func(sh int16) bool { return sh == stuckShard })
	const limit = 200
	var rounds [][]int64
	claim := func(blocked []keyBlock) {
		var excluded []int64
		for _, r := range rounds[max(0, len(rounds)-2):] {
			excluded = append(excluded, r...)
		}
		st.lastFull = true
		got := claimedIDs(t, st, everyShard(), limit, blocked, excluded)
		if len(rounds) >= 2 { // the round before last lands after this claim
			if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1) AND id <> $2`, rounds[len(rounds)-2], stuck); err != nil {
				t.Fatal(err)
			}
		}
		rounds = append(rounds, got)
	}
	claim(nil) // holds the stuck key's event, which fails
	claim(nil) // read ahead
	blocked := []keyBlock{{key: []byte("stuck"), firstID: stuck}}
	const within = 4 // start, confirm, confirm again: the fourth descends none
	for i := 1; ; i++ {
		descend, _ := st.descents(free, st.floorBase())
		if len(descend) == 0 {
			break
		}
		if i > within {
			t.Fatalf("floor read %d still descends %d of the %d free shards (floor proof C=%d), want none from the %dth", i, len(descend), len(free), st.proof.below, within)
		}
		claim(blocked)
		if len(st.floorFrom) == 0 {
			t.Fatalf("claim %d: not a floor read, or its run ended", i)
		}
	}
}

// A run of floor reads that ends (the first came short: the blocked key's
// events dense above the floor) drops its proof and the wait that proof set
// before the next may start: the next run proves its floor by its second
// read, not its claimProofEvery-th.
func TestARunOfFloorReadsThatEndsTakesItsProofsWaitWithIt(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	stuck := insert(st.pool, "stuck")
	// 1,000 events, nine in ten the stuck key's, then 3,000 of other keys.
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', CASE WHEN g % 10 = 0 THEN ('k' || g)::bytea ELSE 'stuck'::bytea END FROM generate_series(1, 1000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ('k' || g)::bytea FROM generate_series(1001, 4000) g`); err != nil {
		t.Fatal(err)
	}
	blocked := []keyBlock{{key: []byte("stuck"), firstID: stuck}}
	claim := func() {
		st.lastFull = true
		got := claimedIDs(t, st, everyShard(), 100, blocked, nil)
		if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, got); err != nil {
			t.Fatal(err)
		}
	}
	claim()
	if st.floorOff == 0 {
		t.Fatal("the first floor read did not come short")
	}
	for st.floorOff > 0 {
		claim() // by the free shards' shares
	}
	floorProofWithin(t, st, 2, "the new run", claim) // one starts, one confirms
}

// A relay keeping up with a trickle through the primary key, each run of
// reads ending at an empty claim with its proof unused, backs off from
// starting them (proofBackoff), so that it does not read pg_locks every
// run. That wait must not outlive the shape: a key blocked next, the first claim beside it reading the free
// shards' shares (the last round not whole), the floor reads that follow
// prove their floor by their second read, not after the wait left over
// from the primary key's reads (found by a cold review).
func TestFloorReadsAfterATrickleThroughThePrimaryKeyProveTheirFloorSoon(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	trickle := func(n int) {
		for i := range n {
			insert(st.pool, fmt.Sprintf("t%d", i))
		}
		got := claimedIDs(t, st, everyShard(), 100, nil, nil)
		if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, got); err != nil {
			t.Fatal(err)
		}
	}
	// Runs of reads through the primary key, each ending at an empty
	// claim with the proof its second read started unused: the wait before
	// the next grows (proofBackoff).
	for i := 0; st.proofWait == 0; i++ {
		if i > 5 {
			t.Fatal("the primary key's wasted runs set no wait before their next proof")
		}
		trickle(5)
		trickle(5) // the run's second read through the primary key: a proof starts
		trickle(0) // an empty claim ends the run
	}
	stuck := insert(st.pool, "stuck")
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key) SELECT 't', 'stuck'::bytea FROM generate_series(1, 300)`); err != nil {
		t.Fatal(err)
	}
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key) SELECT 't', ('k' || (g % 40))::bytea FROM generate_series(1, 2000) g`); err != nil {
		t.Fatal(err)
	}
	blocked := []keyBlock{{key: []byte("stuck"), firstID: stuck}}
	st.lastFull = false
	if stmts := st.claimStatements(everyShard(), 100, blocked, nil); stmts[0].free == nil || stmts[0].floor {
		t.Fatal("the first claim beside the blocked key does not read the shares")
	}
	claim := func() {
		got := claimedIDs(t, st, everyShard(), 100, blocked, nil)
		if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, got); err != nil {
			t.Fatal(err)
		}
	}
	claim()
	floorProofWithin(t, st, 2, "beside the newly blocked key", func() { // one starts, one confirms
		st.lastFull = true
		claim()
	})
}

// Runs of floor-shaped reads too short to use a floor proof (a key blocked
// and released claim by claim while a backlog drains; whole and short
// rounds in turn beside a stuck key) do not start one every run: each
// start reads pg_locks, which takes every lock-table partition's lock.
// After two wasted runs the wait before the next start grows
// (proofBackoff; found by a cold review: every run started one).
func TestShortRunsOfFloorReadsDoNotStartAProofEveryRun(t *testing.T) {
	t.Parallel()
	for _, shape := range []string{"flapping", "whole and short"} {
		t.Run(shape, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			schema := pgtest.Schema(t)
			// The floor proof's pg_locks reads.
			var locks atomic.Int64
			pool := pgtest.TracedPool(t, StatementTracer{See: func(sql string, _ []any) {
				if strings.Contains(sql, "FROM pg_locks") {
					locks.Add(1)
				}
			}}, 0)
			st := newStore(pool, schema)
			outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
			var stuck int64
			if err := pool.QueryRow(ctx, `INSERT INTO `+outbox+` (topic, key) VALUES ('t', 'stuck') RETURNING id`).Scan(&stuck); err != nil {
				t.Fatal(err)
			}
			blocked := []keyBlock{{key: []byte("stuck"), firstID: stuck}}
			const claims = 40
			floorReads := 0
			for i := range claims {
				b := blocked
				switch shape {
				case "flapping": // a backlog; the key blocked every other claim
					if i == 0 {
						if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key) SELECT 't', ('k' || g)::bytea FROM generate_series(1, 30000) g`); err != nil {
							t.Fatal(err)
						}
					}
					if i%2 == 0 {
						b = nil
					}
				case "whole and short": // a whole round, then a short one
					if i%2 == 0 {
						if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key) SELECT 't', ('k' || g)::bytea FROM generate_series(1, 700) g`); err != nil {
							t.Fatal(err)
						}
					}
				}
				got := claimedIDs(t, st, everyShard(), 500, b, nil)
				if b != nil && st.floorKind == shapeFloor && len(st.floorFrom) > 0 {
					floorReads++ // a floor read (that read rows)
				}
				if _, err := pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1) AND id <> $2`, got, stuck); err != nil {
					t.Fatal(err)
				}
			}
			if floorReads < claims/2-1 {
				t.Fatalf("%d floor reads in %d claims: not the shape meant", floorReads, claims)
			}
			if n := locks.Load(); n > 4 {
				t.Fatalf("%d claims, %d of them floor reads in short runs: %d pg_locks reads, want at most 4", claims, floorReads, n)
			}
		})
	}
}

// The backoff after wasted runs (proofBackoff) does not outlast them: a key
// blocked and released claim by claim for a while, then a long drain with
// nothing blocked, then a key stuck for good: its floor reads prove their
// floor by the second read, as on a fresh relay (a cold review: wasted runs
// long ago made a stuck key's episode wait up to claimProofEvery reads).
func TestWastedRunsLongAgoDoNotDelayAStuckKeysProof(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	stuck := insert(st.pool, "stuck")
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key) SELECT 't', ('k' || (g % 500))::bytea FROM generate_series(1, 60000) g`); err != nil {
		t.Fatal(err)
	}
	blocked := []keyBlock{{key: []byte("stuck"), firstID: stuck}}
	claim := func(b []keyBlock) {
		st.lastFull = true
		got := claimedIDs(t, st, everyShard(), 500, b, nil)
		if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1) AND id <> $2`, got, stuck); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 16 { // blocked and released claim by claim
		if i%2 == 1 {
			claim(blocked)
		} else {
			claim(nil)
		}
	}
	if w := st.proofBackoff(shapeFloor); w == 0 {
		t.Fatalf("the flapping key's floor reads (%d runs wasted in a row) back off from no proof", st.wastedRuns[shapeFloor])
	}
	for range 2 * wastedRunsGap { // a long drain, nothing blocked
		claim(nil)
	}
	// One starts, one confirms (the drain's proof is dropped with its shape).
	floorProofWithin(t, st, 2, "beside the stuck key, wasted runs long ago", func() { claim(blocked) })
}

// floorProofWithin claims by claim, each claim a floor read that read rows,
// until a floor proof holds, and fails after within of them. It claims at
// least once: a proof that held before (of another shape) does not count.
func floorProofWithin(t *testing.T, st *store, within int, what string, claim func()) {
	t.Helper()
	for i := 1; ; i++ {
		claim()
		if st.floorKind != shapeFloor || len(st.floorFrom) == 0 {
			t.Fatalf("%s: claim %d is not a floor read that read rows", what, i)
		}
		if st.proof.below != 0 {
			return
		}
		if i == within {
			t.Fatalf("%s: no floor proof after %d floor reads", what, within)
		}
	}
}
