package relay

import (
	"fmt"
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
