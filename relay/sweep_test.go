package relay

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"
)

// keysInShard returns n keys (other than avoid) whose shard is sh.
func keysInShard(sh byte, n int, avoid string) []string {
	var out []string
	for i := 0; len(out) < n; i++ {
		k := fmt.Sprintf("k%d", i)
		if k != avoid && sha256.Sum256([]byte(k))[0] == sh {
			out = append(out, k)
		}
	}
	return out
}

// In a shard holding a blocked key, claims read the other keys by key hash
// from where the last claim stopped, a limited number at a time, not the
// whole shard sorted by id. Every key drains (the high-hash ones are not
// starved by low-hash ones that keep receiving events), each key's events
// come in id order, a claim takes a prefix of each key's pending events,
// and the blocked key's events are never read.
func TestClaimSweepsABlockedShardByKeyHashWithoutStarvingAKey(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	pool := st.pool
	stuckShard := sha256.Sum256([]byte("stuck"))[0]
	keys := keysInShard(stuckShard, 12, "stuck")
	var stuckFirst int64
	for i := range 5 {
		id := insert(pool, "stuck")
		if i == 0 {
			stuckFirst = id
		}
	}
	pending := map[string][]int64{} // key -> ids in order
	for range 4 {
		for _, k := range keys {
			pending[k] = append(pending[k], insert(pool, k))
		}
	}
	// The lowest-hash key keeps receiving a round's worth of events: a
	// claim reading the shard in key-hash order from its start each time
	// would take only those, forever.
	lowest := slices.MinFunc(keys, func(a, b string) int { return bytes.Compare(keyHash([]byte(a)), keyHash([]byte(b))) })
	blocked := []keyBlock{{key: []byte("stuck"), firstID: stuckFirst}}
	shards := []int16{int16(stuckShard)}
	del := `DELETE FROM ` + pgx.Identifier{schema, "outbox"}.Sanitize() + ` WHERE id = ANY($1)`
	var rounds int
	for rounds = 1; rounds <= 40; rounds++ {
		events, err := st.claim(ctx, "me", shards, 5, blocked, nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(events) == 0 {
			t.Fatalf("round %d read nothing with %v pending", rounds, pending)
		}
		var ids []int64
		taken := map[string][]int64{}
		for i, e := range events {
			if i > 0 && events[i-1].id >= e.id {
				t.Fatalf("round %d: events out of id order", rounds)
			}
			if string(e.key) == "stuck" {
				t.Fatalf("round %d read the blocked key's event %d", rounds, e.id)
			}
			taken[string(e.key)] = append(taken[string(e.key)], e.id)
			ids = append(ids, e.id)
		}
		for k, got := range taken {
			if want := pending[k][:len(got)]; !slices.Equal(got, want) {
				t.Fatalf("round %d took %v of key %s, want a prefix of its pending %v", rounds, got, k, pending[k])
			}
			pending[k] = pending[k][len(got):]
			if len(pending[k]) == 0 {
				delete(pending, k)
			}
		}
		if _, err := pool.Exec(ctx, del, ids); err != nil {
			t.Fatal(err)
		}
		for range 5 {
			pending[lowest] = append(pending[lowest], insert(pool, lowest))
		}
		others := 0
		for k := range pending {
			if k != lowest {
				others++
			}
		}
		if others == 0 {
			break
		}
	}
	for k := range pending {
		if k != lowest {
			t.Fatalf("after %d rounds, keys other than the busy one are still pending: %v", rounds-1, pending)
		}
	}
	t.Logf("the other keys drained in %d rounds", rounds)
}

// rotate starts a shard's segments at the sweep position, splitting the
// range that holds it, and keeps every segment exactly once; where it
// splits none, an empty range takes the split's place, so the shard's
// read keeps one text as the sweep moves.
func TestRotateSplitsTheRangeHoldingTheSweepPosition(t *testing.T) {
	t.Parallel()
	segs := blockedSegments([]keyBlock{{key: []byte("stuck"), firstID: 10}})
	sh := int16(sha256.Sum256([]byte("stuck"))[0])
	if len(segs[sh]) != 3 {
		t.Fatalf("segments %v, want below, the blocked hash, above", segs[sh])
	}
	h := keyHash([]byte("stuck"))
	below := append([]byte{h[0]}, 0x01)
	got := rotate(segs[sh], below)
	if len(got) != 4 || !bytes.Equal(got[0].lo, below) || !bytes.Equal(got[3].hi, below) || got[1].eq == nil {
		t.Fatalf("rotate at %x: %+v", below, got)
	}
	for _, from := range [][]byte{h, nil} {
		got := rotate(segs[sh], from)
		if len(got) != 4 || (from != nil) != (got[0].eq != nil) {
			t.Fatalf("rotate at %x: %+v, want four segments, the blocked hash first if from is it", from, got)
		}
		if last := got[3]; last.eq != nil || !bytes.Equal(last.lo, last.hi) {
			t.Fatalf("rotate at %x: %+v, want an empty range last", from, got)
		}
	}
	if sweepOrder([]byte{h[0], 0}, []byte{h[0], 0xff}, []byte{h[0], 0x80}) <= 0 {
		t.Fatal("a hash before the sweep position must come after one past it")
	}
}
