package relay

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// The read of the shards holding blocked keys (see store.claim).

// segment is one index range of outbox_key_hash_idx in a shard holding
// blocked keys: the key hashes in [lo, hi), or (eq set) the hash eq below
// the id before (a blocked key's events ahead of its failed one).
type segment struct {
	lo, hi, eq []byte
	before     int64
}

// at is where the segment starts in key-hash order.
func (g segment) at() []byte {
	if g.eq != nil {
		return g.eq
	}
	return g.lo
}

// blockedSegments returns, for each shard holding blocked keys, its
// segments in key-hash order: the ranges between the blocked keys' hashes,
// and each blocked hash below the id its key is held back from. Another key
// sharing a blocked key's 8-byte hash waits with it: held back, never
// reordered.
func blockedSegments(blocked []keyBlock) map[int16][]segment {
	held := map[string]int64{} // hash -> lowest held-back id
	for _, b := range blocked {
		h := string(keyHash(b.key))
		if id, ok := held[h]; !ok || b.firstID < id {
			held[h] = b.firstID
		}
	}
	out := map[int16][]segment{}
	sorted := slices.Sorted(maps.Keys(held))
	for i, h := range sorted {
		sh := h[0]
		lo := []byte{sh}
		if i > 0 && sorted[i-1][0] == sh {
			lo = []byte(sorted[i-1] + "\x00")
		}
		segs := append(out[int16(sh)],
			segment{lo: lo, hi: []byte(h)},
			segment{eq: []byte(h), before: held[h]})
		if i == len(sorted)-1 || sorted[i+1][0] != sh { // last of its shard
			hi := []byte{sh + 1}
			if sh == 0xff {
				hi = bytes.Repeat([]byte{0xff}, 9)
			}
			segs = append(segs, segment{lo: []byte(h + "\x00"), hi: hi})
		}
		out[int16(sh)] = segs
	}
	return out
}

// rotate returns segs (in key-hash order) starting at the key hash from,
// wrapping around: the range holding from is split there.
func rotate(segs []segment, from []byte) []segment {
	if from == nil {
		return segs
	}
	var after, before []segment
	for _, g := range segs {
		switch {
		case bytes.Compare(g.at(), from) >= 0:
			after = append(after, g)
		case g.eq != nil || bytes.Compare(g.hi, from) <= 0:
			before = append(before, g)
		default: // lo < from < hi
			after = append(after, segment{lo: from, hi: g.hi})
			before = append(before, segment{lo: g.lo, hi: from})
		}
	}
	// A segment starting at from goes first even if it is the blocked hash.
	return append(after, before...)
}

// heldFirst moves a shard's blocked hashes (the events of its blocked keys
// before the id each is held back from) ahead of its key-hash ranges, so
// that the shard's read, cut at its limit, always reaches them: a key whose
// retry is due is read for its failed event there, however many events the
// ranges ahead of it in the sweep hold. They are a few events, not part of
// the sweep (advanceSweeps passes over them).
func heldFirst(segs []segment) []segment {
	out := make([]segment, 0, len(segs))
	for _, g := range segs {
		if g.eq != nil {
			out = append(out, g)
		}
	}
	for _, g := range segs {
		if g.eq == nil {
			out = append(out, g)
		}
	}
	return out
}

// claimBlockedQuery reads the shards holding blocked keys: for each, its
// segments from that shard's sweep position on (rotated), each in index
// order of outbox_key_hash_idx, (key hash, id), so a shard stops reading
// once it has limit events (it runs with bitmap scans off: a bitmap scan
// cannot stop early, and where the planner guesses a range small it would
// read the range whole and sort it): a key stuck with 300,000 events is never
// walked, and neither are the other events of its shard beyond the round.
// Each key's events come in id order, so the events read of each key are a
// prefix of its pending ones, whatever the cut. Ranges and ids are
// parameters ($34 on): they change as the sweep moves, and a text per claim would be
// prepared (and planned) per claim; with bitmap scans off, the plan is an
// ordered index scan per range whatever the estimates. The excluded ids
// are $1 to $33 (notExcluded), left for the caller to set.
func claimBlockedQuery(outbox string, shards [][]segment, limit int) (string, []any) {
	var b strings.Builder
	// $1 to $33: the excluded ids, set by the caller (blockedExcluded).
	args := make([]any, 1+2*claimFloorSkips)
	param := func(v any) int {
		args = append(args, v)
		return len(args)
	}
	b.WriteString(`SELECT * FROM (`)
	for i, segs := range shards {
		if i > 0 {
			b.WriteString(`
UNION ALL `)
		}
		b.WriteString(`(SELECT * FROM (`)
		for j, g := range segs {
			if j > 0 {
				b.WriteString(`
    UNION ALL `)
			}
			if g.eq != nil {
				fmt.Fprintf(&b, `(SELECT `+claimColumns+` FROM %s o WHERE `+keyHashSQL+` = $%d::bytea AND o.id < $%d::bigint AND `+notExcluded+` ORDER BY `+keyHashSQL+`, o.id LIMIT %d)`, outbox, param(g.eq), param(g.before), limit)
			} else {
				fmt.Fprintf(&b, `(SELECT `+claimColumns+` FROM %s o WHERE `+keyHashSQL+` >= $%d::bytea AND `+keyHashSQL+` < $%d::bytea AND `+notExcluded+` ORDER BY `+keyHashSQL+`, o.id LIMIT %d)`, outbox, param(g.lo), param(g.hi), limit)
			}
		}
		fmt.Fprintf(&b, `) AS s LIMIT %d)`, limit)
	}
	fmt.Fprintf(&b, `
) AS m
ORDER BY m.id
LIMIT %d`, limit)
	return b.String(), args
}

// notExcluded leaves out the excluded ids inside each key-hash range,
// before its limit: the runs of them skipRuns found ($2 to $33: lowest and
// highest id each, an empty range where there are fewer runs) by
// comparison, the rest ($1) by a hashed subplan per range (a few per
// blocked shard).
var notExcluded = func() string {
	var b strings.Builder
	b.WriteString(`o.id NOT IN (SELECT unnest($1::bigint[]))`)
	for i := range claimFloorSkips {
		fmt.Fprintf(&b, ` AND o.id NOT BETWEEN $%d::bigint AND $%d::bigint`, 2+2*i, 3+2*i)
	}
	return b.String()
}()

// blockedExcluded sets claimBlockedQuery's arguments for the excluded ids:
// runs and rest as skipRuns returns them.
func blockedExcluded(args []any, runs [][2]int64, rest []int64) {
	args[0] = rest
	for i := range claimFloorSkips {
		lo, hi := int64(1), int64(0) // empty
		if i < len(runs) {
			lo, hi = runs[i][0], runs[i][1]
		}
		args[1+2*i], args[2+2*i] = lo, hi
	}
}

// keyHash is keyHashSQL for a key (or a keyless event's uuid bytes).
func keyHash(key []byte) []byte {
	h := sha256.Sum256(key)
	return h[:8]
}

// eventHash is keyHashSQL for an event.
func eventHash(e *pendingEvent) []byte {
	if e.key != nil {
		return keyHash(e.key)
	}
	var u [16]byte
	_, _ = hex.Decode(u[:], bytes.ReplaceAll(e.eventID, []byte("-"), nil))
	return keyHash(u[:])
}

// advanceSweeps moves the sweep of each blocked shard the round took events
// from to the last key hash it took, in the order the shard was read
// (from its sweep position on, wrapping around): the next claim goes on
// from that key (its events not taken yet) and the keys after it, so over
// rounds every key of the shard gets its turn. The blocked keys' own events
// (a due retry, read ahead of the ranges: heldFirst) do not move it.
func (s *store) advanceSweeps(events []pendingEvent, blockedKeys []keyBlock) {
	if len(s.sweep) == 0 {
		return
	}
	held := make(map[string]bool, len(blockedKeys))
	for _, b := range blockedKeys {
		held[string(keyHash(b.key))] = true
	}
	for i := range events {
		h := eventHash(&events[i])
		sh := int16(h[0])
		from, ok := s.sweep[sh]
		if !ok || held[string(h)] {
			continue
		}
		last := s.sweepLast[sh]
		if last == nil || sweepOrder(h, last, from) > 0 {
			s.sweepLast[sh] = h
		}
	}
	for sh, h := range s.sweepLast {
		s.sweep[sh] = h
		delete(s.sweepLast, sh)
	}
}

// sweepOrder compares key hashes a and b in a sweep starting at from.
func sweepOrder(a, b, from []byte) int {
	aw, bw := bytes.Compare(a, from) < 0, bytes.Compare(b, from) < 0
	if aw != bw {
		if aw {
			return 1
		}
		return -1
	}
	return bytes.Compare(a, b)
}
