package relay

import (
	"context"
	"fmt"
	"math/bits"
	"slices"
	"testing"
)

// heldReadCase is claimFloorCase (the stuck key's oldest events, blocked)
// with n more events above: every stuckEvery-th the stuck key's, the rest
// over 40 other keys, none of them in the stuck key's shard (whose other
// keys a round may leave out when the read below the floor's base stops at
// its limit: mergeBlocked). It claims and deletes floor reads until a floor
// proof holds every free shard: the claims that follow may read through the
// primary key and drop the stuck key's events themselves (a held read).
func heldReadCase(t *testing.T, n, stuckEvery int) (context.Context, *store, string, []keyBlock, [][]byte) {
	t.Helper()
	ctx, st, outbox, _, blocked := claimFloorCase(t)
	stuckShard := keyHash([]byte("stuck"))[0]
	var keys [][]byte
	for i := 0; len(keys) < 40; i++ {
		if k := fmt.Appendf(nil, "k%d", i); keyHash(k)[0] != stuckShard {
			keys = append(keys, k)
		}
	}
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', CASE WHEN g % $2 = 0 THEN 'stuck'::bytea ELSE ($3::bytea[])[1 + g % 40] END FROM generate_series(1, $1) g`, n, stuckEvery, keys); err != nil {
		t.Fatal(err)
	}
	for i := 0; st.proof.below == 0; i++ {
		if i > 2*claimProofEvery {
			t.Fatalf("no floor proof after %d floor reads", i)
		}
		st.lastFull = true
		got := claimedIDs(t, st, everyShard(), 100, blocked, nil)
		if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, got); err != nil {
			t.Fatal(err)
		}
	}
	st.lastFull = true
	return ctx, st, outbox, blocked, keys
}

// Beside a blocked key, with a floor proof holding every free shard and the
// relay owning every shard, the claim reads through the primary key from the
// floor's base and drops the blocked key's events itself (a held read),
// where the floor read's filter in SQL cost 0.2-0.3 ms of a 1 ms read. It
// reads the oldest events that are neither the blocked key's nor in flight,
// a round in flight stepped over as one run, up to where its walk of a
// round stopped (a stuck key's event it dropped makes the round one
// shorter). Where the ids in flight are not one run (a round with a hole
// where it left a held event out), it is the floor read again, which steps
// over several.
func TestHeldReadReadsTheFloorReadsRound(t *testing.T) {
	t.Parallel()
	ctx, st, outbox, blocked, _ := heldReadCase(t, 3000, 300)
	var inFlight []int64
	var besideRun, dropped, floorReads int
	for round := range 12 {
		_, _, isRun := oneRun(slices.Clone(inFlight))
		stmts := st.claimStatements(everyShard(), 100, blocked, inFlight)
		switch {
		case stmts[0].held != nil && isRun:
			besideRun++
		case stmts[0].held != nil && len(inFlight) == 0:
		case stmts[0].held == nil && !isRun && len(inFlight) > 0 && stmts[0].floor:
			floorReads++
		default:
			t.Fatalf("round %d: a held read %v, the floor read %v, with ids in flight that are one run %v (%d ids)", round, stmts[0].held != nil, stmts[0].floor, isRun, len(inFlight))
		}
		st.lastFull = true
		got := claimedIDs(t, st, everyShard(), 100, blocked, inFlight)
		want := oldestFree(t, st, outbox, 100, inFlight)
		if len(got) < 100-100/heldDenseDiv || !slices.Equal(got, want[:len(got)]) {
			t.Fatalf("round %d: claim read %v, want the first %d or more of %v", round, got, 100-100/heldDenseDiv, want)
		}
		if len(got) < 100 {
			dropped++
		}
		if st.heldOff != 0 {
			t.Fatalf("round %d: a held read that dropped a few of the stuck key's events gave way to the floor read", round)
		}
		// The round before goes (its deletes landed), this one stays in
		// flight: the next claim steps over it.
		if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, inFlight); err != nil {
			t.Fatal(err)
		}
		inFlight = got
	}
	if besideRun == 0 || dropped == 0 || floorReads == 0 {
		t.Fatalf("of 12 rounds, %d held reads beside a run in flight, %d dropped a held event, %d floor reads beside several runs: want some of each", besideRun, dropped, floorReads)
	}
}

// Where the blocked key's events are dense above the floor's base (three in
// four here), a held read keeps less than half its round: the claim reads
// from the floor in SQL instead (whose walk goes twice the round, and which
// turns to the free shards' shares where that comes short), and so do the
// claims after it for a while. The round is not empty, holds none of the
// blocked key's events, and each other key's are its oldest.
func TestHeldReadGivesWayWhereTheHeldEventsAreDense(t *testing.T) {
	t.Parallel()
	ctx, st, outbox, blocked, keys := heldReadCase(t, 3000, 50)
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', CASE WHEN g % 4 = 0 THEN ($1::bytea[])[1 + g % 40] ELSE 'stuck'::bytea END FROM generate_series(1, 4000) g`, keys); err != nil {
		t.Fatal(err)
	}
	// Drain what lies below the dense events.
	for {
		st.lastFull = true
		got := claimedIDs(t, st, everyShard(), 100, blocked, nil)
		var dense bool
		if err := st.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE key = 'stuck') > 50 FROM (
    SELECT key FROM `+outbox+` WHERE id > $1 ORDER BY id LIMIT 100) r`, slices.Max(got)).Scan(&dense); err != nil {
			t.Fatal(err)
		}
		if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, got); err != nil {
			t.Fatal(err)
		}
		if dense {
			break
		}
	}
	st.heldOff = 0
	st.lastFull = true
	if stmts := st.claimStatements(everyShard(), 100, blocked, nil); stmts[0].held == nil {
		t.Fatal("the claim is not a held read")
	}
	st.lastFull = true
	events, err := st.claim(ctx, "me", everyShard(), 100, blocked, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(events) == 0 {
		t.Fatal("beside dense held events the claim read nothing: the relay would wait for its next poll")
	}
	byKey := map[string][]int64{}
	for _, e := range events {
		if string(e.key) == "stuck" {
			t.Fatalf("the blocked key's event %d went into the round", e.id)
		}
		byKey[string(e.key)] = append(byKey[string(e.key)], e.id)
	}
	for key, got := range byKey {
		var want []int64
		if err := st.pool.QueryRow(ctx, `SELECT array_agg(id ORDER BY id) FROM (
    SELECT id FROM `+outbox+` WHERE key = $1::bytea ORDER BY id LIMIT $2) k`, key, len(got)).Scan(&want); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("key %s: the round has %v, not its oldest events %v", key, got, want)
		}
	}
	if st.heldOff == 0 {
		t.Fatal("the held read kept less than half its round, and the next claims read through it all the same")
	}
	st.lastFull = true
	if stmts := st.claimStatements(everyShard(), 100, blocked, nil); stmts[0].held != nil {
		t.Fatal("after a dense held read the next claim is a held read again")
	}
}

// A guarded held read (the round's bytes bound on the client) cannot see
// the key of an event it withheld: such an event of the blocked key, kept
// by the bound, sends the claim to read exactly, and the blocked key's
// event stays out of the round.
func TestHeldReadRereadsAWithheldEventOfTheBlockedKey(t *testing.T) {
	t.Parallel()
	ctx, st, outbox, blocked, _ := heldReadCase(t, 3000, 50)
	st.maxBytes = 1 << 20 // a row's share of a round of 100: 10,485 bytes
	var big int64
	if err := st.pool.QueryRow(ctx, `UPDATE `+outbox+` SET value = convert_to(repeat('x', 20000), 'UTF8')
WHERE id = (SELECT min(id) FROM `+outbox+` WHERE key = 'stuck' AND id > (SELECT min(id) FROM `+outbox+` WHERE key <> 'stuck'))
RETURNING id`).Scan(&big); err != nil {
		t.Fatal(err)
	}
	st.lastFull = true
	stmts := st.claimStatements(everyShard(), 100, blocked, nil)
	if stmts[0].held == nil || !stmts[0].guarded {
		t.Fatalf("the claim is not a guarded held read (held %v, guarded %v)", stmts[0].held != nil, stmts[0].guarded)
	}
	st.lastFull = true
	got := claimedIDs(t, st, everyShard(), 100, blocked, nil)
	if slices.Contains(got, big) {
		t.Fatalf("the blocked key's withheld event %d went into the round", big)
	}
	if want := oldestFree(t, st, outbox, 100, nil); !slices.Equal(got, want) {
		t.Fatalf("claim read %v, want %v", got, want)
	}
	if st.exactOff == 0 {
		t.Fatal("the withheld event did not send the claim to read exactly")
	}
}

// A held read leaves out what the floor read leaves out: the events whose
// key's hash (outbox_key_hash_idx's 8 bytes) is a blocked key's, from the
// id the key is held back from. Another key sharing that hash waits with it
// (the key-hash read below the floor's base leaves it out too: were its
// later events published, they would pass its earlier ones). Keyless
// events are held back by id, and a withheld event's key is not known
// (the claim reads exactly if the bound keeps it).
func TestIsHeldGoesByTheKeysHash(t *testing.T) {
	held := heldBack([]keyBlock{{key: []byte("K"), firstID: 10}})
	// Stand in for a key sharing K's hash: K2 held by its own hash.
	held[string(keyHash([]byte("K2")))] = 20
	for _, c := range []struct {
		e    pendingEvent
		want bool
	}{
		{pendingEvent{id: 10, key: []byte("K")}, true},
		{pendingEvent{id: 9, key: []byte("K")}, false},
		{pendingEvent{id: 20, key: []byte("K2")}, true},
		{pendingEvent{id: 19, key: []byte("K2")}, false},
		{pendingEvent{id: 30, key: []byte("K3")}, false},
		{pendingEvent{id: 30, key: nil, eventID: []byte("6f1c3a1e-9d2b-4c1a-8e1f-0a2b3c4d5e6f")}, false},
		{pendingEvent{id: 30, key: nil, withheld: true}, false},
	} {
		if got := isHeld(&c.e, held); got != c.want {
			t.Errorf("event %d of key %q: held %v, want %v", c.e.id, c.e.key, got, c.want)
		}
	}
}

// A held read's rows carry their shard (the first byte of the key's hash,
// or of the event id's for a keyless event), so that the claim hashes only
// the keys of the blocked keys' shards; the events it drops are exactly
// those isHeld holds by the hash, whatever the shards. So too where the
// round's bytes are bound (by default): the guard's wrapper must carry the
// shard through (it once dropped it, and the claim kept every blocked
// key's event: a key's later events went out before its failed one).
func TestAHeldReadHashesOnlyTheBlockedKeysShards(t *testing.T) {
	t.Parallel()
	for _, maxBytes := range []int64{0, 16 << 20} {
		t.Run(fmt.Sprintf("maxBytes=%d", maxBytes), func(t *testing.T) {
			t.Parallel()
			heldReadHashesOnlyTheBlockedKeysShards(t, maxBytes)
		})
	}
}

func heldReadHashesOnlyTheBlockedKeysShards(t *testing.T, maxBytes int64) {
	ctx, st, outbox, blocked, _ := heldReadCase(t, 1000, 7)
	st.maxBytes = maxBytes
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key) SELECT 't', NULL FROM generate_series(1, 50)`); err != nil {
		t.Fatal(err)
	}
	held := heldBack(blocked)
	shards := heldShards(held)
	for h := range held {
		if !shards.has(int16(h[0])) {
			t.Fatalf("heldShards leaves out shard %d of a blocked hash", h[0])
		}
	}
	if n := bits.OnesCount64(shards[0]) + bits.OnesCount64(shards[1]) + bits.OnesCount64(shards[2]) + bits.OnesCount64(shards[3]); n != len(held) {
		t.Fatalf("heldShards holds %d shards for %d blocked hashes in one shard each", n, len(held))
	}
	stmts := st.claimStatements(everyShard(), 2000, blocked, nil)
	if stmts[0].held == nil || stmts[0].guarded != (maxBytes > 0) {
		t.Fatalf("not a held read (guarded %v)", stmts[0].guarded)
	}
	rows, err := st.pool.Query(ctx, stmts[0].sql, stmts[0].args...)
	if err != nil {
		t.Fatal(err)
	}
	events, err := scanEvents(rows, nil)
	if err != nil {
		t.Fatal(err)
	}
	var heldByHash, keyless int
	for i := range events {
		e := &events[i]
		if want := int16(eventHash(e)[0]); e.shard != want {
			t.Fatalf("event %d (key %q): shard %d, want %d", e.id, e.key, e.shard, want)
		}
		if e.key == nil {
			keyless++
		}
		if isHeld(e, held) {
			heldByHash++
		}
	}
	got, err := st.claim(ctx, "me", everyShard(), 2000, blocked, nil)
	if err != nil {
		t.Fatal(err)
	}
	if keyless != 50 || heldByHash == 0 || len(got) != len(events)-heldByHash {
		t.Fatalf("the held read read %d events (%d keyless, %d of the blocked key's hash); the claim kept %d, want %d", len(events), keyless, heldByHash, len(got), len(events)-heldByHash)
	}
}
