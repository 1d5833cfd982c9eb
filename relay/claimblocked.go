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
	held := heldBack(blocked)
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

// heldBack returns, per blocked key hash, the lowest id its keys are held
// back from.
func heldBack(blocked []keyBlock) map[string]int64 {
	held := map[string]int64{}
	for _, b := range blocked {
		h := string(keyHash(b.key))
		if id, ok := held[h]; !ok || b.firstID < id {
			held[h] = b.firstID
		}
	}
	return held
}

// rotate returns segs (in key-hash order) starting at the key hash from,
// wrapping around: the range holding from is split there. Where none is
// split (no from, or from where a segment starts), an empty range goes
// last: the shard's read has one segment more than segs either way, so
// claimBlockedQuery's text (prepared and planned per pool connection)
// does not change as the sweep moves.
func rotate(segs []segment, from []byte) []segment {
	empty := segment{lo: segs[0].at(), hi: segs[0].at()}
	if from == nil {
		return append(slices.Clip(segs), empty)
	}
	var after, before []segment
	split := false
	for _, g := range segs {
		switch {
		case bytes.Compare(g.at(), from) >= 0:
			after = append(after, g)
		case g.eq != nil || bytes.Compare(g.hi, from) <= 0:
			before = append(before, g)
		default: // lo < from < hi
			after = append(after, segment{lo: from, hi: g.hi})
			before = append(before, segment{lo: g.lo, hi: from})
			split = true
		}
	}
	if !split {
		before = append(before, empty)
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
// prefix of its pending ones, whatever the cut. Ranges, ids and the limit
// are parameters (after below): they change as the sweep moves and as the
// rounds fill (store.claimStatements), and a text per claim would be
// prepared (and planned) per claim and pool connection; with bitmap scans
// off, the plan is an ordered index scan per range whatever the estimates.
// The excluded ids come first (notExcluded's, 1+2*claimFloorSkips of
// them), left for the caller to set. The key-hash ranges read only ids
// below the next parameter (below): the floor's base beside a floor
// read, which reads these shards' other keys from the floor up with the
// free shards (see mergeBlocked), else the largest bigint. A blocked key's
// events before its held-back id are read whatever their id, and come
// first, ahead of the limit across the shards: a key whose retry is due is
// read for its failed event however many events the ranges hold below the
// base, in its shard or another.
func claimBlockedQuery(outbox string, shards [][]segment, limit int, below int64) (string, []any) {
	var b strings.Builder
	// The excluded ids, set by the caller (blockedExcluded), then below.
	args := make([]any, 1+2*claimFloorSkips, 3+2*claimFloorSkips+8*len(shards))
	args = append(args, below, limit)
	belowParam, limitParam := len(args)-1, len(args)
	param := func(v any) int {
		args = append(args, v)
		return len(args)
	}
	b.WriteString(`SELECT id, event_id, topic, key, value, headers, created_at, refused_for, refused_kind, size FROM (`)
	held := 0 // segments of the blocked keys' own events, across the shards
	for i, segs := range shards {
		if i > 0 {
			b.WriteString(`
UNION ALL `)
		}
		b.WriteString(`(SELECT * FROM (`)
		shardHeld := 0
		for j, g := range segs {
			if j > 0 {
				b.WriteString(`
    UNION ALL `)
			}
			if g.eq != nil {
				shardHeld++
				fmt.Fprintf(&b, `(SELECT `+claimColumns+`, true AS held FROM %s o WHERE `+keyHashSQL+` = $%d::bytea AND o.id < $%d::bigint AND `+notExcluded+` ORDER BY `+keyHashSQL+`, o.id LIMIT $%d::bigint)`, outbox, param(g.eq), param(g.before), limitParam)
			} else {
				fmt.Fprintf(&b, `(SELECT `+claimColumns+`, false AS held FROM %s o WHERE `+keyHashSQL+` >= $%d::bytea AND `+keyHashSQL+` < $%d::bytea AND o.id < $%d::bigint AND `+notExcluded+` ORDER BY `+keyHashSQL+`, o.id LIMIT $%d::bigint)`, outbox, param(g.lo), param(g.hi), belowParam, limitParam)
			}
		}
		fmt.Fprintf(&b, `) AS s LIMIT $%d::bigint + %d)`, limitParam, shardHeld)
		held += shardHeld
	}
	// The blocked keys' own events first: the limit across the shards
	// must not leave a due retry's failed event out for another shard's
	// older events (mergeBlocked would then drop the floor read's copy).
	// And room for them beyond the limit, one event per blocked key (a
	// due key's failed one): many keys falling due at once would fill the
	// limit and leave some out, their holds dropped (forgetLostRetries).
	fmt.Fprintf(&b, `
) AS m
ORDER BY m.held DESC, m.id
LIMIT $%d::bigint + %d`, limitParam, held)
	return b.String(), args
}

// notExcluded leaves out the excluded ids inside each key-hash range,
// before its limit: the runs of them skipRuns found ($2 on: lowest and
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
// (a due retry, read ahead of the ranges: heldFirst) do not move it, nor do
// events read from the floor (mergeBlocked).
func (s *store) advanceSweeps(events []pendingEvent, blockedKeys []keyBlock) {
	if len(s.sweep) == 0 {
		return
	}
	held := make(map[string]bool, len(blockedKeys))
	for _, b := range blockedKeys {
		held[string(keyHash(b.key))] = true
	}
	for i := range events {
		if !events[i].swept {
			continue // read from the floor (mergeBlocked)
		}
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

// mergeBlocked makes one round of a floor read and the read of the shards
// holding blocked keys below its base (out: their rows, in any order). A
// key of such a shard has its events below the base from the latter and
// from the floor up from the former: together all of its pending events
// up to where the floor read stopped, unless the read by key hash stopped
// at its limit (across the shards it reads). (A read bound by bytes in SQL
// may stop below its limit, so it counts as cut too; claimStatements does
// not merge such a read with the floor read, and a guarded read sends
// every row, so its count tells.) Then it may have left a key's events out
// below the base whose later events the floor read has: the floor read's
// rows of every shard holding blocked keys are dropped, leaving each key a
// prefix of its events, and cut is true. (A withheld row is kept
// whatever its shard, which its missing key hides: the claim reads exactly
// once the round's bound reaches it.)
func mergeBlocked(out []pendingEvent, stmts []statement) (merged []pendingEvent, cut bool) {
	var st *statement
	for i := range stmts {
		if stmts[i].sweepLimit > 0 && stmts[i].belowBase {
			st = &stmts[i]
		}
	}
	if st == nil {
		return out, false
	}
	swept := 0
	for i := range out {
		if out[i].swept {
			swept++
		}
	}
	if swept < st.sweepLimit && !st.boundInSQL {
		return out, false
	}
	return slices.DeleteFunc(out, func(e pendingEvent) bool {
		if e.swept || e.withheld {
			return false
		}
		_, found := slices.BinarySearch(st.sweptShards, int16(eventHash(&e)[0]))
		return found
	}), true
}

// dedupByID drops the second of two events of one id (in id order): an
// event read both from the floor and by key hash (mergeBlocked), keeping
// the copy that carries its key and value.
func dedupByID(events []pendingEvent) []pendingEvent {
	if len(events) < 2 {
		return events
	}
	out := events[:1]
	for _, e := range events[1:] {
		last := &out[len(out)-1]
		if e.id != last.id {
			out = append(out, e)
			continue
		}
		swept := last.swept || e.swept
		if last.withheld && !e.withheld {
			*last = e
		}
		last.swept = swept
	}
	return out
}
