package relay

import (
	"fmt"
	"slices"
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

// claimFloorMaxOut is the most shards not free (blocked, or not owned) with
// which the free shards are read by claimFloorQuery: it walks their rows
// above the floor and drops them.
const claimFloorMaxOut = 8

// claimFloorOff is how many claims read by claimFreeQuery after a read by
// claimFloorQuery came short: the rows not free above the floor may be too
// dense to walk.
const claimFloorOff = 16

// claimFloorQuery reads the free shards ($1) when nearly every shard is
// free and the last round was whole (a backlog is draining beside a blocked
// key): the primary key in id order from the floor, the lowest pending id
// of the free shards (one descent of outbox_shard_id_idx per shard, taken in
// the same statement, so in the same snapshot: no late-committed row of a
// free shard lies below it), leaving out the rows of the other shards ($2)
// and the excluded ids ($3). A blocked key's events below the floor (a key
// stuck with 300,000 events, the oldest of the table) are never walked; its
// events above the floor are, and dropped. claimFreeQuery reads a share of
// every free shard instead (eight events each for 255 shards), about 2.5
// times the buffers, and sorts twice the round.
//
// The walk stops after twice the round of rows not excluded: where the
// dropped rows are denser than that, the read comes short and the claim
// reads by claimFreeQuery instead (store.claim). Each key's events in the
// round are all of its pending ones from the floor up to where the read
// stopped: a prefix, in id order.
func claimFloorQuery(outbox string, limit int) string {
	return fmt.Sprintf(`SELECT id, event_id, topic, key, value, headers, created_at, refused_for, refused_kind, size FROM (
SELECT `+claimColumns+`, o.shard
FROM %s o
WHERE o.id >= (SELECT min(f.id) FROM unnest($1::int2[]) AS s(shard),
        LATERAL (SELECT p.id FROM %s p WHERE p.shard = s.shard ORDER BY p.id LIMIT 1) AS f)
    AND o.id NOT IN (SELECT unnest($3::bigint[]))
ORDER BY o.id
LIMIT %d) AS o
WHERE o.shard <> ALL($2::int2[])
ORDER BY o.id
LIMIT %d`, outbox, outbox, 2*limit, limit)
}

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
