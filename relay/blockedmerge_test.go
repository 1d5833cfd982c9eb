package relay

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"
)

// keyPending returns each key's pending ids (committed, not deleted, not
// excluded) in id order, keyless events by their event id.
func keyPending(t *testing.T, st *store, outbox string, excluded []int64) map[string][]int64 {
	t.Helper()
	rows, _ := st.pool.Query(context.Background(), `SELECT id, coalesce(encode(key, 'hex'), 'keyless:' || event_id::text) FROM `+outbox+`
WHERE id <> ALL($1::bigint[]) ORDER BY id`, append([]int64{}, excluded...))
	out := map[string][]int64{}
	var id int64
	var key string
	if _, err := pgx.ForEachRow(rows, []any{&id, &key}, func() error {
		out[key] = append(out[key], id)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

func eventKeyOf(e *pendingEvent) string {
	if e.key == nil {
		return "keyless:" + string(e.eventID)
	}
	return fmt.Sprintf("%x", e.key)
}

// checkPrefixRound asserts G3 on a claimed round: ids strictly increasing, each
// key's events a prefix of its pending ones, no blocked key's event at or
// above its held-back id.
func checkPrefixRound(t *testing.T, what string, events []pendingEvent, pending map[string][]int64, blocked []keyBlock) {
	t.Helper()
	taken := map[string][]int64{}
	for i := range events {
		e := &events[i]
		if i > 0 && events[i-1].id >= e.id {
			t.Fatalf("%s: ids out of order or duplicated: %d then %d", what, events[i-1].id, e.id)
		}
		if e.withheld {
			t.Fatalf("%s: returned withheld event %d", what, e.id)
		}
		for _, b := range blocked {
			if string(e.key) == string(b.key) && e.id >= b.firstID {
				t.Fatalf("%s: read blocked key %q's event %d (held back from %d)", what, b.key, e.id, b.firstID)
			}
		}
		k := eventKeyOf(e)
		taken[k] = append(taken[k], e.id)
	}
	for k, ids := range taken {
		all := pending[k]
		if len(ids) > len(all) || !slices.Equal(ids, all[:len(ids)]) {
			n := min(len(all), len(ids)+3)
			t.Fatalf("%s: took %v of key %s, want a prefix of its pending %v", what, ids, k, all[:n])
		}
	}
}

// Beside a floor read, a round with events larger than the byte bound's
// share: guarded, the blocked shard's read by key hash sends every row it
// reads; exact (after a guarded claim withheld an event the bound kept),
// it is bound by bytes in SQL and may stop for that far below its count
// limit, so the floor read leaves that shard to it alone. A version that
// merged the two and looked only at the key-hash read's count kept the
// floor read's rows of that shard: a key got a later (small) event from
// the floor read while the earlier (large) one the key-hash read cut was
// left out.
func TestBlockedShardKeyHashReadCutByBytesKeepsFloorRows(t *testing.T) {
	t.Parallel()
	for _, exact := range []bool{false, true} {
		t.Run(fmt.Sprintf("exact=%v", exact), func(t *testing.T) {
			t.Parallel()
			testKeyHashReadCutByBytes(t, exact)
		})
	}
}

func testKeyHashReadCutByBytes(t *testing.T, exact bool) {
	ctx, st, schema, _ := claimSetup(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	ins := func(key string, size int) int64 { return insertSized(t, st, schema, key, size) }
	stuckFirst := ins("stuck", 10)
	for range 20 {
		ins("stuck", 10)
	}
	k := keysInShard(sha256.Sum256([]byte("stuck"))[0], 2, "stuck")
	a := ins(k[0], 100)      // small, same shard
	k2 := ins(k[1], 150_000) // large: a + k2 > maxBytes
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 't', ('f' || (g % 40))::bytea, '\x00'::bytea FROM generate_series(1, 50) g`); err != nil {
		t.Fatal(err)
	}
	k3 := ins(k[1], 100) // small, the same key as k2, after it
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 't', ('f' || (g % 40))::bytea, '\x00'::bytea FROM generate_series(1, 500) g`); err != nil {
		t.Fatal(err)
	}
	st.maxBytes = 120_000 // a share of 1,200 bytes in a round of 100: the floor read is guarded
	blocked := []keyBlock{{key: []byte("stuck"), firstID: stuckFirst}}
	st.lastFull = true
	if exact {
		st.exactOff = claimExactOff
	}
	pending := keyPending(t, st, outbox, nil)
	stmts := st.claimStatements(everyShard(), 100, blocked, nil)
	if last := stmts[len(stmts)-1]; last.sweepLimit == 0 || last.boundInSQL != exact {
		t.Fatalf("the key-hash read: sweep %d, bound in SQL %v; want bound in SQL %v", last.sweepLimit, last.boundInSQL, exact)
	}
	if exact {
		st.exactOff = claimExactOff
	}
	events, err := st.claim(ctx, "me", everyShard(), 100, blocked, nil)
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]int64, len(events))
	for i := range events {
		ids[i] = events[i].id
	}
	t.Logf("a=%d k2=%d k3=%d; round %v", a, k2, k3, ids)
	checkPrefixRound(t, "round 1", events, pending, blocked)
}

// roundDriver runs a relay's claims with a read-ahead (each claim leaves
// out the round in flight, and the round before it is deleted), checking
// every round, until nothing but the blocked keys' held events is left.
type roundDriver struct {
	t       *testing.T
	st      *store
	outbox  string
	shards  []int16
	limit   int
	blocked func(round int) []keyBlock
	before  func(round int) // before each claim (late commits, inserts)
	rounds  int             // at most
	// filled in
	depth    int // rounds in flight (1 if 0)
	inFlight []int64
	flights  [][]int64
	// what the rounds were: floor reads, events read by key hash, events
	// of the blocked shards read from the floor
	floorRounds, swept, fromFloor, proofRounds int
}

func (d *roundDriver) run() {
	t := d.t
	ctx := context.Background()
	empty := 0
	for round := 0; round < d.rounds; round++ {
		if d.before != nil {
			d.before(round)
		}
		blocked := d.blocked(round)
		pending := keyPending(t, d.st, d.outbox, d.inFlight)
		events, err := d.st.claim(ctx, "me", d.shards, d.limit, blocked, slices.Clone(d.inFlight))
		if err != nil {
			t.Fatal(err)
		}
		checkPrefixRound(t, fmt.Sprintf("round %d", round), events, pending, blocked)
		for i := range events {
			if sh := int16(eventHash(&events[i])[0]); !slices.Contains(d.shards, sh) {
				t.Fatalf("round %d read event %d of shard %d, not owned", round, events[i].id, sh)
			}
		}
		if len(d.st.floorFrom) > 0 {
			d.floorRounds++
		}
		if d.st.proof.below > 0 {
			d.proofRounds++
		}
		bsh := map[int16]bool{}
		for _, b := range blocked {
			bsh[int16(keyHash(b.key)[0])] = true
		}
		for i := range events {
			switch {
			case events[i].swept:
				d.swept++
			case events[i].key != nil && bsh[int16(keyHash(events[i].key)[0])]:
				d.fromFloor++
			}
		}
		var got []int64
		for i := range events {
			got = append(got, events[i].id)
		}
		d.flights = append(d.flights, got)
		if len(d.flights) > max(1, d.depth) {
			if _, err := d.st.pool.Exec(ctx, `DELETE FROM `+d.outbox+` WHERE id = ANY($1)`, d.flights[0]); err != nil {
				t.Fatal(err)
			}
			d.flights = d.flights[1:]
		}
		d.inFlight = slices.Concat(d.flights...)
		if len(got) == 0 {
			if empty++; empty >= 2 {
				t.Logf("%d rounds: %d floor reads (%d with a floor proof), %d events by key hash, %d of the blocked shards from the floor", round+1, d.floorRounds, d.proofRounds, d.swept, d.fromFloor)
				d.drained(blocked)
				return
			}
		} else {
			empty = 0
		}
	}
	t.Fatalf("not drained after %d rounds: %d events pending", d.rounds, d.count())
}

func (d *roundDriver) count() int {
	var n int
	if err := d.st.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+d.outbox).Scan(&n); err != nil {
		d.t.Fatal(err)
	}
	return n
}

// drained asserts that only the blocked keys' held events are left.
func (d *roundDriver) drained(blocked []keyBlock) {
	d.t.Helper()
	rows, _ := d.st.pool.Query(context.Background(), `SELECT id, key FROM `+d.outbox+` WHERE shard = ANY($1) ORDER BY id`, d.shards)
	var id int64
	var key []byte
	var left []string
	if _, err := pgx.ForEachRow(rows, []any{&id, &key}, func() error {
		for _, b := range blocked {
			if string(b.key) == string(key) && id >= b.firstID {
				return nil
			}
		}
		if !slices.Contains(d.inFlight, id) {
			left = append(left, fmt.Sprintf("%d:%s", id, key))
		}
		return nil
	}); err != nil {
		d.t.Fatal(err)
	}
	if len(left) > 0 {
		d.t.Fatalf("claims stopped with unblocked events pending (starved): %v", left[:min(20, len(left))])
	}
}

// fillKeys inserts n events of keys (round robin by a stride) with value
// sizes from size.
func fillKeys(t *testing.T, st *store, outbox string, keys []string, n int, size int) {
	t.Helper()
	if _, err := st.pool.Exec(context.Background(), `INSERT INTO `+outbox+` (topic, key, value)
SELECT 't', ($1::text[])[1 + (g * 7) % cardinality($1::text[])]::bytea, decode(repeat('00', $3), 'hex') FROM generate_series(1, $2) g`, keys, n, size); err != nil {
		t.Fatal(err)
	}
}

func keysOutside(n int, avoid ...byte) []string {
	var out []string
	for i := 0; len(out) < n; i++ {
		k := fmt.Sprintf("free%d", i)
		if !slices.Contains(avoid, sha256.Sum256([]byte(k))[0]) {
			out = append(out, k)
		}
	}
	return out
}

func shardOf(k string) byte { return sha256.Sum256([]byte(k))[0] }

// The blocked shard's other keys hold many more events than the key-hash
// read's limit (64 once rounds are full), interleaved with the free keys':
// the key-hash read stops at its limit round after round.
func TestBlockedShardKeysAboveTheKeyHashLimit(t *testing.T) {
	for _, depth := range []int{1, 2} {
		t.Run(fmt.Sprint("depth ", depth), func(t *testing.T) {
			t.Parallel()
			ctx, st, outbox, _, blocked := claimFloorCase(t)
			sh := shardOf("stuck")
			keys := keysInShard(sh, 6, "stuck")
			keys = append(keys, keysOutside(40, sh)...)
			fillKeys(t, st, outbox, keys, 6000, 1)
			_ = ctx
			d := &roundDriver{t: t, st: st, outbox: outbox, shards: everyShard(), limit: 100, depth: depth,
				blocked: func(int) []keyBlock { return blocked }, rounds: 400}
			d.run()
		})
	}
}

// Several blocked keys: two in one shard, three in other shards, each held
// back from a later event (its events before that pending, read in order),
// their shards' other keys busy.
func TestSeveralBlockedKeysInOneAndInDifferentShards(t *testing.T) {
	for _, depth := range []int{1, 2} {
		t.Run(fmt.Sprint("depth ", depth), func(t *testing.T) {
			t.Parallel()
			ctx, st, schema, insert := claimSetup(t)
			outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
			b1 := "stuck"
			b2 := keysInShard(shardOf(b1), 1, b1)[0]
			others := keysOutside(3, shardOf(b1))
			blockedKeys := append([]string{b1, b2}, others...)
			var shardsOf []byte
			var keys []string
			for _, k := range blockedKeys {
				shardsOf = append(shardsOf, shardOf(k))
			}
			for _, k := range blockedKeys {
				for _, o := range keysInShard(shardOf(k), 3, k) {
					if !slices.Contains(blockedKeys, o) && !slices.Contains(keys, o) {
						keys = append(keys, o)
					}
				}
			}
			keys = append(keys, keysOutside(30, shardsOf...)...)
			held := map[string]int64{}
			for round := range 6 {
				for i, k := range blockedKeys {
					id := insert(st.pool, k)
					if round == 2+i%3 {
						held[k] = id
					}
				}
				fillKeys(t, st, outbox, keys, 500, 1)
			}
			var blocked []keyBlock
			for _, k := range blockedKeys {
				blocked = append(blocked, keyBlock{key: []byte(k), firstID: held[k]})
			}
			_ = ctx
			st.lastFull = true
			d := &roundDriver{t: t, st: st, outbox: outbox, shards: everyShard(), limit: 100, depth: depth,
				blocked: func(int) []keyBlock { return blocked }, rounds: 400}
			d.run()
		})
	}
}

// The blocked shard's other keys have an old backlog (older than the free
// keys' events), and the relay carries a base far above it (as
// TestClaimFromTheFloorReadsTheOldestEventsWhateverItsBase: a shard handed
// over, a key released): the key-hash read reads below the base, at its
// limit for many rounds, and the floor read's rows of that shard are
// dropped meanwhile.
func TestBlockedShardBacklogBelowACarriedBase(t *testing.T) {
	for _, c := range []struct {
		name  string
		base  func(first, last int64) int64
		depth int
	}{
		{"no base", func(int64, int64) int64 { return 0 }, 1},
		{"base mid-way", func(f, l int64) int64 { return (f + l) / 2 }, 1},
		{"base mid-way, depth 2", func(f, l int64) int64 { return (f + l) / 2 }, 2},
		{"base above all", func(f, l int64) int64 { return l + 1000 }, 1},
		{"base at the first free", func(f, l int64) int64 { return f }, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			_, st, outbox, insert, blocked := claimFloorCase(t)
			sh := shardOf("stuck")
			bkeys := keysInShard(sh, 5, "stuck")
			fillKeys(t, st, outbox, bkeys, 600, 1)
			free := keysOutside(40, sh)
			first := insert(st.pool, free[0])
			fillKeys(t, st, outbox, append(slices.Clone(free), bkeys...), 4000, 1)
			last := insert(st.pool, free[1])
			if b := c.base(first, last); b > 0 {
				st.floorFrom = []int64{b}
			}
			d := &roundDriver{t: t, st: st, outbox: outbox, shards: everyShard(), limit: 100, depth: c.depth,
				blocked: func(int) []keyBlock { return blocked }, rounds: 400}
			d.run()
		})
	}
}

// A key whose retry is due is read for its failed event (held back from
// the event after it) whatever the blocked shards' other keys hold
// (TestClaimReadsADueRetryWhateverItsShardsOtherKeysHold): here beside a
// floor read, with that event just above the base (among the round's
// oldest events) and more events than the key-hash read's limit below the
// base, in the due key's shard or in another blocked shard.
//   - Same shard: a version that bounded the blocked key's own events by
//     the base too ($34) did not read the failed event by key hash, and
//     mergeBlocked dropped the floor read's copy: the relay then dropped
//     the key's hold (forgetLostRetries).
//   - Another shard: the key-hash read's outer LIMIT, by id across the
//     blocked shards, kept the other shard's older events and cut the
//     failed event (ed2584d too, before the merge). The blocked keys' own
//     events now come first.
func TestDueRetryAboveTheBaseBesideABacklogBelowIt(t *testing.T) {
	for _, sameShard := range []bool{true, false} {
		t.Run(fmt.Sprint("same shard ", sameShard), func(t *testing.T) {
			t.Parallel()
			ctx, st, outbox, insert, blocked := claimFloorCase(t)
			sh := shardOf("stuck")
			ks := keysInShard(sh, 6, "stuck")
			fillKeys(t, st, outbox, ks[:5], 70, 1) // the backlog below the base
			due := ks[5]
			if !sameShard {
				for i := 0; ; i++ {
					if k := fmt.Sprintf("due%d", i); shardOf(k) != sh {
						due = k
						break
					}
				}
			}
			free := keysOutside(40, sh, shardOf(due))
			base := insert(st.pool, free[0])
			failed := insert(st.pool, due) // the due key's failed event
			insert(st.pool, due)
			fillKeys(t, st, outbox, free, 1000, 1)
			blocked = append(blocked, keyBlock{key: []byte(due), firstID: failed + 1})
			events := claimAboveABase(ctx, t, st, outbox, base, blocked)
			for i := range events {
				if events[i].id == failed {
					return
				}
			}
			t.Fatalf("the due retry's failed event %d (base %d, among the round's oldest) was not read; %d events", failed, base, len(events))
		})
	}
}

// A row of the blocked shard's other key commits late, below the base by
// then, while the shard's other keys hold a backlog (the key-hash read at
// its limit) and the late key's next event, committed early, lies above
// the base where the floor read reads it.
func TestLateCommitInTheBlockedShardBelowTheBase(t *testing.T) {
	for _, backlog := range []int{0, 30, 300} {
		for _, commitAt := range []int{1, 3, 8} {
			t.Run(fmt.Sprintf("backlog %d, commit at %d", backlog, commitAt), func(t *testing.T) {
				t.Parallel()
				ctx, st, outbox, insert, blocked := claimFloorCase(t)
				sh := shardOf("stuck")
				ks := keysInShard(sh, 6, "stuck")
				lateKey := ks[5]
				tx, err := st.pool.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback(ctx)
				lateID := insert(tx, lateKey) // below every other row but the stuck key's
				if backlog > 0 {
					fillKeys(t, st, outbox, ks[:5], backlog, 1)
				}
				free := keysOutside(40, sh)
				fillKeys(t, st, outbox, free, 300, 1)
				fillKeys(t, st, outbox, append(slices.Clone(free), ks[:5]...), 1500, 1)
				insert(st.pool, lateKey) // its next event, committed first
				fillKeys(t, st, outbox, append(slices.Clone(free), ks[:5]...), 1500, 1)
				d := &roundDriver{t: t, st: st, outbox: outbox, shards: everyShard(), limit: 100, rounds: 400,
					blocked: func(int) []keyBlock { return blocked },
					before: func(round int) {
						if round == commitAt {
							if b := st.floorBase(); b <= lateID && st.proof.below <= lateID {
								t.Fatalf("base %d not above the late row %d", b, lateID)
							}
							if err := tx.Commit(ctx); err != nil {
								t.Fatal(err)
							}
						}
					}}
				d.run()

			})
		}
	}
}

// Randomized relay runs: keys in a few hot shards and free shards, keyless
// events, inserts every round, transactions that commit late (ids below
// the base by the time they commit), keys blocked and released (held from
// their oldest pending event, or due: held from the one after it), a
// read-ahead of one or two rounds, a relay owning every shard or all but
// three, and per mode a byte bound: none; "guarded", a share that
// withholds some values; "bound", the default bound (a share no event
// reaches: every read guarded, none withholding, so the held read is
// guarded too); "sql", a share below minGuardShare (every read
// bound by bytes in SQL); "toggle", a guarded share with values above it
// and some near the bound (guarded claims that keep a withheld event and
// claim again exactly, then exact claims for a while). Every round is
// checked: each key's events a prefix of its pending ones, no blocked
// key's held events. At the end nothing but held events is left.
func TestRandomizedBlockedRuns(t *testing.T) {
	for _, mode := range []string{"none", "guarded", "bound", "sql", "toggle"} {
		for seed := range 4 {
			t.Run(fmt.Sprintf("%s seed %d", mode, seed), func(t *testing.T) {
				t.Parallel()
				randomBlockedRun(t, mode, int64(seed))
			})
		}
	}
}

func randomBlockedRun(t *testing.T, mode string, seed int64) {
	rng := rand.New(rand.NewPCG(uint64(seed), uint64(len(mode))))
	ctx, st, schema, _ := claimSetup(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	hot := []byte{shardOf("stuck"), shardOf("hot-a"), shardOf("hot-b")}
	var keys []string
	for _, sh := range hot {
		keys = append(keys, keysInShard(sh, 6, "")...)
	}
	keys = append(keys, keysOutside(30, hot...)...)
	shards := everyShard()
	if seed%2 == 1 {
		// a relay that owns every shard but three: one hot shard and two
		// free keys' shards are another relay's (their keys may be blocked)
		out := []int16{int16(hot[2]), int16(shardOf(keys[len(keys)-1])), int16(shardOf(keys[len(keys)-2]))}
		shards = slices.DeleteFunc(shards, func(sh int16) bool { return slices.Contains(out, sh) })
	}
	limit := 100
	size := func() int { return 1 }
	switch mode {
	case "bound":
		st.maxBytes = 16 << 20
	case "guarded":
		st.maxBytes = 400_000 // a share of 4,000 in a round of 100; 64 × 5,000 < 400,000
		size = func() int {
			if rng.IntN(8) == 0 {
				return 5_000 // above the share: withheld by a guarded read
			}
			return 1
		}
	case "sql":
		st.maxBytes = 60_000 // share 600 < minGuardShare
		size = func() int {
			if rng.IntN(50) == 0 {
				return 3_000 + rng.IntN(20_000)
			}
			return 1 + rng.IntN(100)
		}
	case "toggle":
		st.maxBytes = 200_000 // share 2,000
		size = func() int {
			switch rng.IntN(200) {
			case 0:
				return 2_500 + rng.IntN(5_000) // withheld
			case 1:
				if rng.IntN(4) == 0 {
					return 120_000 // withheld, most of the bound
				}
			}
			return 1 + rng.IntN(100)
		}
	}
	ins := func(db execer, n int) {
		batch, sizes := make([][]byte, n), make([]int32, n)
		for i := range n {
			if rng.IntN(20) > 0 { // else keyless
				batch[i] = []byte(keys[rng.IntN(len(keys))])
			}
			sizes[i] = int32(size())
		}
		if _, err := db.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 't', k, decode(repeat('00', s), 'hex') FROM unnest($1::bytea[], $2::int4[]) WITH ORDINALITY AS x(k, s, n) ORDER BY n`, batch, sizes); err != nil {
			t.Fatal(err)
		}
	}
	ins(st.pool, 1500)
	type late struct {
		tx     pgx.Tx
		commit int
	}
	var lates []late
	blockedNow := map[string]int64{} // key -> firstID
	oldest := func(k string, excluded []int64) int64 {
		var id *int64
		if err := st.pool.QueryRow(ctx, `SELECT min(id) FROM `+outbox+` WHERE key = $1::bytea AND id <> ALL($2::bigint[])`, k, append([]int64{}, excluded...)).Scan(&id); err != nil {
			t.Fatal(err)
		}
		if id == nil {
			return 0
		}
		return *id
	}
	st.lastFull = true
	var d *roundDriver
	stopAt := 140
	d = &roundDriver{t: t, st: st, outbox: outbox, shards: shards, limit: limit, depth: 1 + int(seed/2%2), rounds: 2000,
		before: func(round int) {
			if round < stopAt {
				ins(st.pool, 80+rng.IntN(60))
				if rng.IntN(4) == 0 {
					tx, err := st.pool.Begin(ctx)
					if err != nil {
						t.Fatal(err)
					}
					ins(tx, 1+rng.IntN(20))
					lates = append(lates, late{tx, round + 1 + rng.IntN(8)})
				}
			}
			for i := 0; i < len(lates); i++ {
				if lates[i].commit <= round || round >= stopAt {
					if err := lates[i].tx.Commit(ctx); err != nil {
						t.Fatal(err)
					}
					lates = slices.Delete(lates, i, i+1)
					i--
				}
			}
			if round < stopAt && rng.IntN(4) == 0 {
				k := keys[rng.IntN(len(keys))]
				if _, ok := blockedNow[k]; ok {
					delete(blockedNow, k)
				} else if len(blockedNow) < 5 {
					if id := oldest(k, d.inFlight); id > 0 {
						if rng.IntN(2) == 0 {
							id++ // due: its failed event is read alone
						}
						blockedNow[k] = id
					}
				}
			}
			if round == stopAt {
				clear(blockedNow) // let everything drain
			}
		},
		blocked: func(int) []keyBlock {
			var out []keyBlock
			for k, id := range blockedNow {
				out = append(out, keyBlock{key: []byte(k), firstID: id})
			}
			slices.SortFunc(out, func(a, b keyBlock) int { return bytes.Compare(a.key, b.key) })
			// at most claimFloorMaxOut shards out, or the claims leave
			// the floor read this test is about
			for len(out) > 0 {
				sh := map[byte]bool{}
				for _, b := range out {
					sh[keyHash(b.key)[0]] = true
				}
				if len(sh)+NumShards-len(shards) <= claimFloorMaxOut {
					break
				}
				out = out[1:]
			}
			return out
		},
	}
	d.run()
}

// Under sustained load (every round full), a blocked key stuck, the other
// keys of its shard receive an event now and then: each is read (how many
// rounds it waited is logged), and every round is whole and read from the
// floor, per byte mode: unbounded, guarded (share above minGuardShare,
// small values), and bound in SQL (share below minGuardShare).
func TestBlockedShardLatencyUnderLoad(t *testing.T) {
	for _, mode := range []string{"none", "guarded", "sql"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			blockedShardUnderLoad(t, mode)
		})
	}
}

func blockedShardUnderLoad(t *testing.T, mode string) {
	ctx, st, outbox, insert, blocked := claimFloorCase(t)
	sh := shardOf("stuck")
	bkeys := keysInShard(sh, 4, "stuck")
	free := keysOutside(60, sh)
	switch mode {
	case "guarded":
		st.maxBytes = 1 << 20
	case "sql":
		st.maxBytes = 60_000
	}
	limit := 100
	fillKeys(t, st, outbox, free, 3000, 1)
	born := map[int64]int{}
	var flights [][]int64
	var inFlight []int64
	maxWait, total, n, short, floorRounds := 0, 0, 0, 0, 0
	for round := 0; round < 300; round++ {
		fillKeys(t, st, outbox, free, limit+5, 1) // more than a round: the backlog stays
		if round%3 == 0 && round < 250 {
			born[insert(st.pool, bkeys[round%len(bkeys)])] = round
		}
		events, err := st.claim(ctx, "me", everyShard(), limit, blocked, append([]int64{}, inFlight...))
		if err != nil {
			t.Fatal(err)
		}
		if len(events) < limit {
			short++
		}
		if len(st.floorFrom) > 0 {
			floorRounds++
		}
		var got []int64
		for i := range events {
			got = append(got, events[i].id)
			if r, ok := born[events[i].id]; ok {
				w := round - r
				maxWait = max(maxWait, w)
				total += w
				n++
				delete(born, events[i].id)
			}
		}
		flights = append(flights, got)
		if len(flights) > 1 {
			if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, flights[0]); err != nil {
				t.Fatal(err)
			}
			flights = flights[1:]
		}
		inFlight = nil
		for _, f := range flights {
			inFlight = append(inFlight, f...)
		}
	}
	t.Logf("%s: %d of the blocked shard's other keys' events read, waited max %d rounds (mean %.1f), %d never read; %d short rounds of 300, %d floor reads",
		mode, n, maxWait, float64(total)/float64(max(n, 1)), len(born), short, floorRounds)
	if len(born) > 0 {
		t.Fatalf("%d of the blocked shard's other keys' events never read", len(born))
	}
	// A version that read the blocked shard with the free ones while the
	// bytes were bound in SQL dropped its rows from every round: 84 short
	// rounds of 300, each sending the next claim to the shares.
	if short > 0 || floorRounds < 300 {
		t.Fatalf("%d short rounds and %d floor reads of 300 under a backlog that fills every round", short, floorRounds)
	}
}

// The floor read comes short (the stuck key's held events are denser than
// the round above the floor) and the claim reads the shares instead, while
// the key-hash read beside it read only below the base: the stuck shard's
// other keys keep a prefix, and nothing is lost over the rounds.
func TestShortFloorReadBesideAKeyHashReadBelowTheBase(t *testing.T) {
	t.Parallel()
	ctx, st, outbox, insert, blocked := claimFloorCase(t)
	sh := shardOf("stuck")
	ks := keysInShard(sh, 3, "stuck")
	free := keysOutside(40, sh)
	fillKeys(t, st, outbox, append(slices.Clone(ks), free...), 300, 1)
	base := insert(st.pool, free[0])
	fillKeys(t, st, outbox, ks, 30, 1)
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key) SELECT 't', 'stuck'::bytea FROM generate_series(1, 1000)`); err != nil {
		t.Fatal(err)
	}
	fillKeys(t, st, outbox, append(slices.Clone(ks), free...), 600, 1)
	st.floorFrom = []int64{base}
	st.lastFull = true
	d := &roundDriver{t: t, st: st, outbox: outbox, shards: everyShard(), limit: 100, rounds: 200,
		blocked: func(int) []keyBlock { return blocked }}
	d.run()
}

// A hot shard holding a blocked key: its other keys have half the events,
// or 80% and more arriving than a round each claim, and a backlog below
// the base more than the key-hash read's limit. The merge drops the floor
// read's rows of that shard while the key-hash read is at its limit (64,
// its share of a round), and the round comes short by those. Two versions
// lost the run of floor reads there, each sending the next claim to the
// shares, which starts the floor's base and proof over:
//   - the key-hash read stayed at 64 after such a round: the shard's rows
//     dropped from the floor read fell below the base faster than 64 a
//     claim drained them (half: 3 rounds of 30 short). It now reads a
//     whole round's worth after one at its limit (sweptFull);
//   - a round short only of the dropped rows was taken for the end of the
//     backlog (lastFull): the next floor read had no base, and its
//     key-hash read the shard at 64 again, short again, the claims
//     alternating for as long as the load lasted (80%: 25 of 50 short).
func TestRoundsStayWholeBesideAHotBlockedShard(t *testing.T) {
	for _, c := range []struct {
		name            string
		hot, free       int // keys in the blocked shard and outside it
		backlog, arrive int // events at the start, and before each claim
		rounds, warmup  int
	}{
		{name: "half", hot: 6, free: 6, backlog: 6000, rounds: 30},
		{name: "80%", hot: 8, free: 2, backlog: 3000, arrive: 110, rounds: 60, warmup: 10},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx, st, outbox, insert, blocked := claimFloorCase(t)
			sh := shardOf("stuck")
			hot := keysInShard(sh, c.hot, "stuck")
			fillKeys(t, st, outbox, hot, 300, 1) // below the base
			base := insert(st.pool, "free-base")
			keys := append(keysOutside(c.free, sh), hot...)
			fillKeys(t, st, outbox, keys, c.backlog, 1)
			st.floorFrom = []int64{base}
			st.lastFull = true
			var inFlight []int64
			short, floors := 0, 0
			var sizes []int
			for round := range c.rounds {
				if c.arrive > 0 {
					fillKeys(t, st, outbox, keys, c.arrive, 1)
				}
				pending := keyPending(t, st, outbox, inFlight)
				events, err := st.claim(ctx, "me", everyShard(), 100, blocked, slices.Clone(inFlight))
				if err != nil {
					t.Fatal(err)
				}
				checkPrefixRound(t, fmt.Sprint("round ", round), events, pending, blocked)
				sizes = append(sizes, len(events))
				if round >= c.warmup {
					if len(events) < 100 {
						short++
					}
					if len(st.floorFrom) > 0 {
						floors++
					}
				}
				if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, inFlight); err != nil {
					t.Fatal(err)
				}
				inFlight = inFlight[:0]
				for i := range events {
					inFlight = append(inFlight, events[i].id)
				}
			}
			if n := c.rounds - c.warmup; short > 0 || floors < n {
				t.Fatalf("after %d rounds, %d of %d rounds short of 100 and %d floor reads, with thousands pending (sizes %v)", c.warmup, short, n, floors, sizes)
			}
		})
	}
}

// Many keys' retries fall due at once (a partition's outage ended), more
// than the key-hash read's share of a full round (64 here): each due key's
// failed event, below the floor's base, is read by key hash alone, and
// every one of them must come back, or the relay drops the hold of the
// keys left out and their backoff starts over (forgetLostRetries). The
// read's limit leaves room for the blocked keys' own events.
func TestManyDueRetriesBesideAFloorRead(t *testing.T) {
	t.Parallel()
	ctx, st, outbox, insert, blocked := claimFloorCase(t)
	sh := shardOf("stuck")
	other := shardOf(keysOutside(1, sh)[0])
	dueKeys := append(keysInShard(sh, 50, "stuck"), keysInShard(other, 50, "")...)
	failed := map[int64]bool{}
	for _, k := range dueKeys {
		id := insert(st.pool, k)
		failed[id] = true
		blocked = append(blocked, keyBlock{key: []byte(k), firstID: id + 1})
	}
	for _, k := range dueKeys {
		insert(st.pool, k) // held behind the failed one
	}
	free := keysOutside(40, sh, other)
	base := insert(st.pool, free[0])
	fillKeys(t, st, outbox, free, 1000, 1)
	events := claimAboveABase(ctx, t, st, outbox, base, blocked)
	for i := range events {
		delete(failed, events[i].id)
	}
	if len(failed) > 0 {
		t.Fatalf("%d of %d due retries' failed events not read (the round's %d events)", len(failed), len(dueKeys), len(events))
	}
}

// claimAboveABase claims a round of 100 from the floor, the earlier floor
// reads having read from base on, and checks that it is a prefix of each
// key's pending events.
func claimAboveABase(ctx context.Context, t *testing.T, st *store, outbox string, base int64, blocked []keyBlock) []pendingEvent {
	t.Helper()
	st.floorFrom = []int64{base}
	st.lastFull = true
	pending := keyPending(t, st, outbox, nil)
	events, err := st.claim(ctx, "me", everyShard(), 100, blocked, nil)
	if err != nil {
		t.Fatal(err)
	}
	checkPrefixRound(t, "claim", events, pending, blocked)
	return events
}
