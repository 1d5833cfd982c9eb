package relay

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
)

// claimFreeMin is the fewest free shards (owned, no blocked key) read by
// claimFreeQuery rather than claimShardsQuery's merge.
const claimFreeMin = NumShards / 4

// claimFreeQuery reads many free shards with one small plan, whatever
// their number: for each shard ($1) its oldest k ($2, per shard) pending
// events not excluded ($3), by a LATERAL index range of
// outbox_shard_id_idx, then the oldest limit of those. The merge of
// claimShardsQuery reads fewer buffers but costs one plan node per shard:
// with 255 shards (every shard owned, one holding a blocked key) its
// generic plan ran 2-3 times slower than this one at about 1.4 times the
// buffers, and its text took 50-190 ms to plan, six times per pool
// connection and again whenever the set of blocked shards changed.
//
// Each shard's events in the round are a prefix of its pending events (the
// oldest of its candidates), so each key's come in id order; the oldest
// pending event of the free shards is always a candidate, so no shard
// starves. The round is not the free shards' oldest events overall when a
// shard has more than k of them among those: freeKs lets such a shard read
// twice as many next time, so a hot key gets whole rounds within a few
// claims.
func claimFreeQuery(outbox string, limit int) string {
	return fmt.Sprintf(`SELECT * FROM (
SELECT `+claimColumns+`
FROM unnest($1::int2[], $2::int4[]) AS s(shard, k),
LATERAL (SELECT * FROM %s o
    WHERE o.shard = s.shard AND o.id NOT IN (SELECT unnest($3::bigint[]))
    ORDER BY o.id LIMIT s.k) AS o
) AS o
ORDER BY o.id
LIMIT %d`, outbox, limit)
}

// freeKs returns claimFreeQuery's per-shard limits for free: a share of the
// round (twice the round over the shards, at least 4), or, for a shard
// whose whole read made the last round, twice what it read then (at most
// the round). The shards read more than their share in a claim add up to
// at most twice the last round, so a claim reads at most that plus the
// shares.
func (s *store) freeKs(free []int16, limit int) []int32 {
	base := max(4, (2*limit+len(free)-1)/len(free))
	ks := make([]int32, len(free))
	for i, sh := range free {
		ks[i] = int32(min(limit, max(base, s.freeK[sh])))
	}
	return ks
}

// adaptFreeKs records, after a claim that read free with limits ks, which
// shards should read more next time: those whose every candidate made the
// round (out) double their limit; the others go back to the share.
func (s *store) adaptFreeKs(free []int16, ks []int32, out []pendingEvent) {
	counts := map[int16]int{}
	for i := range out {
		counts[int16(eventHash(&out[i])[0])]++
	}
	clear(s.freeK)
	for i, sh := range free {
		if counts[sh] >= int(ks[i]) {
			s.freeK[sh] = 2 * int(ks[i])
		}
	}
}

// claimFloorMaxOut is the most shards not free (holding blocked keys, or
// not owned) with which the free shards are read by claimFloorQuery: it
// walks the rows above the floor of the shards not owned, and the blocked
// keys' held events, and drops them.
const claimFloorMaxOut = 8

// claimFloorOff is how many claims read by claimFreeQuery after a read by
// claimFloorQuery came short: the rows it drops above the floor (shards
// not owned, blocked keys' held events) may be too dense to walk.
const claimFloorOff = 16

// claimFloorQuery reads the owned shards when nearly every shard is free
// and the last round was whole (a backlog is draining beside a blocked
// key): the primary key in id order from the floor (found by descending the
// free shards, $1), leaving out the rows of the shards not owned ($2), the
// excluded ids ($3) and the blocked keys' held events. A blocked key's events
// below the floor (a key stuck with 300,000 events, the oldest of the
// table) are never walked; its events above the floor are, and dropped.
// claimFreeQuery reads a share of every free shard instead (eight events
// each for 255 shards), about 2.5 times the buffers, and sorts twice the
// round.
//
// The floor is found in the same statement, so in the same snapshot: the
// least of the base ($4) and the lowest pending id below the base of each
// shard in $1 (one descent of outbox_shard_id_idx per shard). $1 holds every
// free shard but those a floor proof (claimproof.go) holds, which have
// nothing pending below the base and never will: the proof's C is then the
// base (store.descents). Every pending row of a free shard is at or above
// the floor, a row that committed late included (below the base, its
// shard's descent finds it, or the proof showed none can exist; at or
// above, the base is no higher): the base only says where the descents may
// stop. Without a proof, store.floorBase keeps it below the rows the earlier
// rounds deleted, so the descents stop before their index entries (dead,
// but marked so only by a scan after every older snapshot ended): walked
// by each of 255 descents, they cost a heap visit each, a thousand and more
// a claim; walked once in id order by the read, next to each other. With
// one, the base follows the rounds (a proof is renewed every few floor
// reads), and the read walks past fewer of them.
//
// The read steps over runs of excluded ids (consecutive integers, each
// wholly excluded: the rounds in flight) instead of fetching their rows to
// drop them (two rounds, 2,000 rows, for a read-ahead): it reads a number
// of index ranges of the primary key (branches; $5 on: each range's lowest
// and highest id, inclusive; floorBranches makes them the ranges between
// the runs), merged in id order. $3 holds the other excluded ids only
// (skipRuns).
//
// The walk stops after twice the round of rows not excluded: where the
// dropped rows are denser than that, the read comes short and the claim
// reads by claimFreeQuery instead (store.claim). Each key's events in the
// round are all of its pending ones from the floor up to where the read
// stopped: a prefix, in id order.
//
// The owned shards holding blocked keys are read with the free shards,
// leaving out only the blocked keys' events from the id each is held back
// from: the shards at $(5+2*branches), the blocked keys' hashes (keyHashSQL)
// and those ids after it. Their other keys' events below the base (at or
// above the floor) are read by key hash (claimBlockedQuery), and the claim
// merges the two (mergeBlocked). Where the round's bytes are bound in SQL
// those shards are in $2 instead and read by key hash alone
// (claimStatements).
func claimFloorQuery(outbox string, limit, branches int) string {
	var b strings.Builder
	fmt.Fprintf(&b, `WITH f AS MATERIALIZED (
    SELECT coalesce(min(f.id), $4::bigint) AS id FROM unnest($1::int2[]) AS s(shard),
        LATERAL (SELECT p.id FROM %s p WHERE p.shard = s.shard AND p.id < $4::bigint ORDER BY p.id LIMIT 1) AS f)
SELECT id, event_id, topic, key, value, headers, created_at, refused_for, refused_kind, size FROM (
SELECT * FROM (`, outbox)
	for i := range branches {
		if i > 0 {
			b.WriteString(`
UNION ALL `)
		}
		fmt.Fprintf(&b, `(SELECT `+claimColumns+`, o.shard
FROM %s o
WHERE o.id >= (SELECT f.id FROM f) AND o.id BETWEEN $%[2]d::bigint AND $%[3]d::bigint AND $%[2]d::bigint <= $%[3]d::bigint
    AND o.id NOT IN (SELECT unnest($3::bigint[]))
ORDER BY o.id
LIMIT %[4]d)`, outbox, 5+2*i, 6+2*i, 2*limit)
	}
	// The blocked keys' events from where each is held back on are left
	// out in a CASE: only for rows of the shards holding them ($n), so the
	// key's hash is computed for a few rows a round.
	n := 5 + 2*branches
	fmt.Fprintf(&b, `
) AS u
ORDER BY u.id
LIMIT %d) AS o
WHERE o.shard <> ALL($2::int2[])
    AND CASE WHEN o.shard = ANY($%d::int2[]) THEN NOT EXISTS (
        SELECT FROM unnest($%d::bytea[], $%d::bigint[]) AS h(hash, from_id)
        WHERE h.hash = `+keyHashSQL+` AND o.id >= h.from_id) ELSE true END
ORDER BY o.id
LIMIT %d`, 2*limit, n, n+1, n+2, limit)
	return b.String()
}

// claimFloorSkips is the most runs of excluded ids claimFloorQuery steps
// over, and claimFloorSkipMin the fewest ids in such a run: shorter ones
// are walked and dropped. A floor read always has claimFloorSkips+1
// branches (floorBranches), so a pool connection prepares and plans one
// floor-read text, not one per count of runs: the first floor reads beside
// a newly blocked key met 0, 5, 1, 5 and 3 runs, and each new text cost
// 1-2 ms of parsing and planning per connection on the drain's critical
// path.
const (
	claimFloorSkips   = 4
	claimFloorSkipMin = 16
)

// floorBranches returns claimFloorQuery's branches for runs (in id order,
// disjoint, at most claimFloorSkips): the ranges of ids around them, each
// inclusive, then empty ranges (1 to 0) up to claimFloorSkips+1. A branch
// whose bounds are the wrong way round is never run (the query's
// "$lo <= $hi", a one-time filter above its index scan): an unused branch
// costs nothing, where an empty range's scan would still descend the
// primary key (PostgreSQL 15 does not see the contradiction first).
func floorBranches(runs [][2]int64) [][2]int64 {
	out := make([][2]int64, 0, claimFloorSkips+1)
	lo, open := int64(math.MinInt64), true
	for _, r := range runs {
		if open && r[0] > lo {
			out = append(out, [2]int64{lo, r[0] - 1})
		}
		lo, open = r[1]+1, r[1] < math.MaxInt64
	}
	if open {
		out = append(out, [2]int64{lo, math.MaxInt64})
	}
	for len(out) < claimFloorSkips+1 {
		out = append(out, [2]int64{1, 0})
	}
	return out
}

// skipRuns returns the runs of consecutive ids in excluded (sorted in
// place) that claimFloorQuery steps over, as lowest and highest id each, in
// id order: the claimFloorSkips longest of at least claimFloorSkipMin ids;
// and rest, the excluded ids outside them, which the reads leave out by
// their NOT IN. A NOT IN's hash is built per index range read (one more
// than the runs for the floor read, one per key-hash range for a blocked
// shard's read): on the 2,000 ids of a read-ahead's rounds, 4 ms a claim
// for a blocked shard's read of 64 events. Up to claimFloorSkips runs: the
// rounds in flight beside a blocked key are one run, but may be split where
// a round left out a blocked shard's events (the first floor read of a run,
// a key-hash read at its limit, a round bound by bytes in SQL).
func skipRuns(excluded []int64) (runs [][2]int64, rest []int64) {
	slices.Sort(excluded)
	for i := 0; i < len(excluded); {
		j := i
		for j+1 < len(excluded) && excluded[j+1] <= excluded[j]+1 {
			j++
		}
		if excluded[j]-excluded[i]+1 >= claimFloorSkipMin {
			runs = append(runs, [2]int64{excluded[i], excluded[j]})
		}
		i = j + 1
	}
	if len(runs) > claimFloorSkips {
		slices.SortFunc(runs, func(a, b [2]int64) int { return cmp.Compare(b[1]-b[0], a[1]-a[0]) })
		runs = runs[:claimFloorSkips]
		slices.SortFunc(runs, func(a, b [2]int64) int { return cmp.Compare(a[0], b[0]) })
	}
	rest = []int64{}
	k := 0
	for _, id := range excluded {
		for k < len(runs) && runs[k][1] < id {
			k++
		}
		if k == len(runs) || id < runs[k][0] {
			rest = append(rest, id)
		}
	}
	return runs, rest
}

// claimFloorLag is how many floor reads back store.floorBase looks.
const claimFloorLag = 64

// floorBase returns claimFloorQuery's base when no floor proof holds
// (store.descents): the lowest id the last claimFloorLag floor reads in a
// row read (a backlog draining beside a blocked key: the first of them), or
// no base (the descents go to each shard's lowest pending id) for the first
// of a run of floor reads. Such a run also ends the floor proof
// (noteFloor).
//
// The rows deleted since are read past in id order, as claimAllQuery reads
// past every row deleted since the last vacuum; walked by 255 descents,
// each whose index entry is not yet marked dead (a scan marks it once no
// snapshot older than the delete is left, which another session's long
// transaction holds off) costs a heap visit on a page of its own.
func (s *store) floorBase() int64 {
	if len(s.floorFrom) == 0 {
		return math.MaxInt64
	}
	return slices.Min(s.floorFrom)
}

// noteFloor records where a floor read started (the lowest id it read), or,
// for a claim that read no rows from the floor (from == 0), that floor
// reads start over without a base (the run ends: endRun).
func (s *store) noteFloor(from int64) {
	if from == 0 {
		s.floorFrom = s.floorFrom[:0]
		s.proof, s.proving = floorProof{}, nil
		s.endRun()
		s.proofWait = s.proofBackoff(s.floorKind)
		return
	}
	if len(s.floorFrom) == claimFloorLag {
		s.floorFrom = append(s.floorFrom[:0], s.floorFrom[1:]...)
	}
	s.floorFrom = append(s.floorFrom, from)
}

// readShape is the shape of a claim's read that keeps a floor proof going
// (floorShape).
type readShape int

const (
	shapeFloor  readShape = iota // a claimFloorQuery read (or a held read)
	shapeAll                     // a claimAllQuery read
	shapeShards                  // a claimShardsQuery read
	numShapes
)

// floorShape starts the floor reads' history (floorFrom, and the floor
// proof drawn from it) over when a claim's read changes between the shapes
// that keep one: a claimAllQuery read, a claimFloorQuery read, and a
// claimShardsQuery read. A claimAll read starts at the oldest pending
// event, a key's that is about to be blocked among them; the floor reads
// that follow once it is must not take those ids for their base, nor for a
// proof's id: they would walk that key's events from there, come short of
// the round and send the next claimFloorOff claims to the free shards'
// shares. The wait before the next proof goes with the dropped one, whether
// or not there is a history: the new shape's wait is what its own wasted
// runs earned (proofBackoff), so the first floor read beside a newly
// blocked key starts theirs (else it descended every free shard for
// claimProofEvery claims, or as long as a trickle's claimAll reads had to
// wait).
func (s *store) floorShape(shape readShape) {
	if s.floorKind != shape {
		s.floorFrom = s.floorFrom[:0]
		s.proof, s.proving = floorProof{}, nil
		s.endRun()
		s.proofWait = s.proofBackoff(shape)
	}
	s.floorKind = shape
}

// endRun accounts for a run of floor-shaped reads of the current shape that
// ended (noteFloor, floorShape): one that started a floor proof it never
// read with (a proof holding a shard it descended, or every shard for
// claimAll) was wasted; one that read with its proof ends the shape's
// wasted runs in a row.
func (s *store) endRun() {
	i := s.floorKind
	switch {
	case s.runStarted && !s.runUsed:
		if s.claimN-s.lastWasted[i] > wastedRunsGap {
			s.wastedRuns[i] = 0 // not in a row: long ago
		}
		s.wastedRuns[i]++
		s.lastWasted[i] = s.claimN
	case s.runStarted:
		s.wastedRuns[i] = 0
	}
	s.runStarted, s.runUsed = false, false
}

// proofBackoff is the wait (floor-shaped claims) before a run of shape i
// may start a proof, by its runs that were wasted in a row (endRun): none
// after one (a stuck key's episode, whose first floor reads follow a run
// that ended at once, proves its floor by its second read), then 2, 4, up
// to claimProofEvery. Runs of one or two floor reads (the relay catching
// up with a trickle in whole and short rounds, a key blocked and released
// claim by claim) would otherwise start a proof, reading pg_locks, in every
// run and never use it. Wasted runs more than wastedRunsGap claims apart
// are not in a row: a key blocked for a claim now and then does not make
// the next stuck key's episode wait.
func (s *store) proofBackoff(i readShape) int {
	wasted := s.wastedRuns[i]
	if wasted <= 1 || s.claimN-s.lastWasted[i] > wastedRunsGap {
		return 0
	}
	return min(claimProofEvery, 1<<(wasted-1))
}

// wastedRunsGap is how many claims apart two wasted runs of a shape may end
// and still count as in a row (proofBackoff).
const wastedRunsGap = 4 * claimProofEvery

// floorCameShort reports whether rows, a claimFloorQuery read of a round
// of limit, may have stopped short of the round for its walk's bound (not
// for the round's byte bound: then the next row would not have fitted, as
// far as the largest row read tells).
func (s *store) floorCameShort(rows []pendingEvent, limit int) bool {
	if len(rows) >= limit {
		return false
	}
	var total, largest int64
	for i := range rows {
		total += rows[i].size
		largest = max(largest, rows[i].size)
	}
	return s.maxBytes == 0 || total+largest <= s.maxBytes
}

// freeAbove reports whether any of the free shards holds a pending event
// above id that is not excluded: one descent of outbox_shard_id_idx per
// shard, stopping at the first such event. A claimFloorQuery read that came
// short of the round with none read all there is to read from its floor
// (the end of a backlog); with one, its walk stopped at its bound and the
// claim reads by the shares instead. Without this, the last round of
// every backlog drained beside a blocked key paid for the shares read too
// (claimFreeQuery: 70 ms, a tenth of the drain of 50,000 events).
func (s *store) freeAbove(ctx context.Context, free []int16, id int64, excluded []int64) (bool, error) {
	if excluded == nil {
		excluded = []int64{}
	}
	var more bool
	err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM unnest($1::int2[]) AS s(shard),
    LATERAL (SELECT FROM `+s.outbox+` p WHERE p.shard = s.shard AND p.id > $2::bigint
        AND p.id NOT IN (SELECT unnest($3::bigint[])) LIMIT 1) AS p)`, free, id, excluded).Scan(&more)
	if err != nil {
		return false, fmt.Errorf("read past the floor: %w", err)
	}
	return more, nil
}

// notIn returns the shards (of all NumShards) not in sorted.
func notIn(sorted []int16) []int16 {
	out := make([]int16, 0, NumShards-len(sorted))
	for sh := int16(0); sh < NumShards; sh++ {
		if _, found := slices.BinarySearch(sorted, sh); !found {
			out = append(out, sh)
		}
	}
	return out
}
