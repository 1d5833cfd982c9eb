package relay

import (
	"context"
	"fmt"
	"math"

	"github.com/jackc/pgx/v5"
)

// A floor proof lets claimFloorQuery skip its per-shard descents (255 of
// them beside a blocked key: 1,477 of the floor read's 1,975 buffers at
// 350,000 rows, and more once the base moves past deleted rows):
// it holds the shards that have no pending event below an id C, and no
// event below C can become pending any more. Below the base a descent can
// only find a row its earlier reads did not see: one that committed late
// (its id handed out before the rows that set the base, its transaction
// ended after), an event left pending by a round or a retry, or the events
// of a shard this relay did not read then (blocked, or another relay's).
// The proof covers all of them:
//
//  1. Start: read the identity sequence's next id M (ids
//     below it are all handed out: the sequence must have CACHE 1, a
//     positive increment and no CYCLE, or no proof is tried), then, from
//     pg_locks, the virtual transaction ids of the transactions holding
//     the sequence's RowExclusiveLock. nextval takes that lock before it
//     hands out a value and keeps it to the end of the top transaction, so
//     every transaction that holds an id below M and has not ended is
//     among them, whether it has an xid or not (an id default evaluated
//     before a BEFORE trigger that waits, nextval called early). The
//     candidate C is the lesser of M and the lowest id the floor read
//     before the last one read (claimProofBack), or, for the first floor
//     read of a run, the lowest id that read itself reads (queueFloorProof).
//  2. Wait: a later claim checks that none of those
//     virtual transaction ids is held any more, and that no prepared
//     transaction holds the sequence's lock. A transaction's virtualxid
//     lock is released after its commit is visible (as CREATE INDEX
//     CONCURRENTLY relies on); PREPARE moves its other locks to the
//     prepared transaction (pid NULL in pg_locks) before it releases its
//     virtualxid. From then on every row with an id below C is final:
//     visible to any later snapshot, or never coming.
//  3. Confirm: a statement after that, so in a later
//     snapshot, descends each of the 256 shards once and returns those
//     with no pending row below C. Rows are only deleted from then on, so
//     this stays true whoever owns the shard, whether it is blocked, and
//     whatever is in flight or waiting out a retry (those rows are pending:
//     their shards are not in the proof).
//
// A floor read then descends only the free shards the proof does not hold,
// with C for its base, and reads exactly what it would read with every
// descent from that base. A claimAllQuery read (one relay, every shard,
// nothing blocked) starts at C when the proof holds every shard: nothing
// is pending below C, so it reads the same round, but descends to C once
// instead of walking the index entries of every row deleted since the last
// vacuum from the left edge (a dead prefix that grows with the backlog
// drained: autovacuum does not run within a drain). A claimShardsQuery read
// (a relay owning some of the shards, none blocked) starts each shard the
// proof holds at C for the same reason: the index range of each of its
// shards has its own dead prefix.
//
// Ids must come from the identity in the transaction that inserts the
// row (GENERATED ALWAYS; OVERRIDING SYSTEM VALUE with an id taken by
// another, ended transaction, or setval backwards, defeats it as it
// defeats any order of ids).
//
// Each step is one statement added to a claim's batch (no round trip of
// its own), and only floor reads, claimAllQuery and claimShardsQuery reads
// take them (a "floor read" below is any of them: each records the lowest
// id it read); pg_locks
// (which takes every lock-table partition's lock; 0.07-0.15 ms here) is read at the start and then at most once per floor read while
// waiting (backing off to every claimProofEvery-th), and a new proof is
// started at most every claimProofEvery floor reads of one run, once the
// reads have moved past C. A run of floor reads that ends (store.noteFloor)
// or a change of shape (store.floorShape) drops it and its wait: the next
// run starts one at once (a claimFloorQuery run at its first read), unless
// the runs of that shape before it kept ending with a proof started and
// never read with, when the wait grows (store.endRun, proofBackoff): runs
// too short to use a proof do not read pg_locks every run.
type floorProof struct {
	below int64 // C; 0: no proof
	sure  [NumShards / 64]uint64
}

func (p *floorProof) holds(sh int16) bool { return p.sure[sh/64]&(1<<(sh%64)) != 0 }

// holdsAll reports whether the proof holds every shard: no row below C is
// pending, nor ever will be, and a claimAllQuery read may start at C.
func (p *floorProof) holdsAll() bool {
	if p.below == 0 {
		return false
	}
	for _, w := range p.sure {
		if w != ^uint64(0) {
			return false
		}
	}
	return true
}

// proving is a floor proof under way.
type proving struct {
	state  int      // proofHolders, proofWaiting or proofConfirm
	below  int64    // the candidate C
	vxids  []string // the transactions that may still commit an id below C
	checks int      // checks of vxids so far
	skip   int      // floor reads to let pass before the next check
	usable bool     // the sequence allows a proof (CACHE 1, increment > 0, no CYCLE)
	// ownFloor: below is to come down to the floor of the read that
	// started it (store.claim, once that read is read; or of a later floor
	// read, where that claim ended before: any floor read's is below the
	// next id read at the start). recheck: confirm it a second time, a floor
	// read after the first (see queueFloorProof).
	ownFloor, recheck bool
}

const (
	proofHolders = iota // the start's statements are in flight
	proofWaiting        // waiting for vxids to end
	proofConfirm        // they ended: confirm in the next claim
)

// claimProofEvery is how many floor reads at least separate the starts of
// two floor proofs while the reads keep their shape (store.floorShape).
const claimProofEvery = 8

// claimProofBack is how many floor reads before the last one a proof's
// candidate C comes from: the lowest id that read read. The rounds read
// since are above it; the ones before have landed (been deleted) by the
// time the proof is confirmed, a few claims on, unless they failed, and
// a row left pending below C only keeps its shard out of the proof. (The
// first floor read of a run has no such history: queueFloorProof.)
const claimProofBack = 1

// proofSequence finds the outbox's id sequence, once.
func (s *store) proofSequence(ctx context.Context) error {
	if s.seqChecked {
		return nil
	}
	var seq *string
	var dbOID uint32
	err := s.pool.QueryRow(ctx, `SELECT pg_get_serial_sequence($1, 'id'), d.oid
FROM pg_database d WHERE d.datname = current_database()`, s.outbox).Scan(&seq, &dbOID)
	if err != nil {
		return fmt.Errorf("find the id sequence: %w", err)
	}
	s.seqChecked = true
	if seq == nil {
		return nil // no proof: the floor reads descend every shard
	}
	s.seqName, s.dbOID = *seq, dbOID
	return nil
}

// queueFloorProof adds this claim's step of a floor proof to b, with what
// to do with its answer, if one is due. Called for claims that read from
// the floor or through claimAllQuery, after the claim's own statements are
// queued; floorRead: the claim has a claimFloorQuery read.
//
// The first floor read of a run (no history to draw C from) starts a proof
// whose C is its own floor, set once the read is read (ownFloor): with no
// transaction holding an id, the second floor read confirms it, so the
// first floor reads of a stuck key's episode, its costliest (255 descents,
// planned afresh on each pool connection they meet), are two, not three.
// Everything that read left out lies below C: the rounds in flight, and
// the one whose deletes are being recorded (one relay owning every shard
// reads ahead without waiting for them: Relay.readAheadWaits), so the
// first confirm may leave their shards out. Such a proof is confirmed a
// second time, a floor read on, descending only the shards the first left
// out: sound at any later time, as rows below C are only deleted, and by
// then those rounds have landed. A row left pending below C (a failed
// round) keeps its shard out.
func (s *store) queueFloorProof(b *pgx.Batch, floorRead bool) {
	if s.seqName == "" {
		return
	}
	if s.proofWait > 0 {
		s.proofWait--
	}
	p := s.proving
	if p != nil && p.state == proofHolders {
		p, s.proving = nil, nil // the batch that started it failed
	}
	switch {
	case p == nil:
		n := len(s.floorFrom)
		if s.proofWait > 0 || n == 0 && !floorRead {
			return
		}
		from := int64(math.MaxInt64) // this read's floor (ownFloor)
		if n > 0 {
			from = s.floorFrom[max(0, n-1-claimProofBack)]
			if from <= s.proof.below {
				return
			}
		}
		p = &proving{state: proofHolders, below: from, ownFloor: n == 0, recheck: n == 0}
		s.proving = p
		s.proofWait = claimProofEvery
		s.runStarted = true
		b.Queue(`SELECT CASE WHEN s.is_called THEN s.last_value + 1 ELSE s.last_value END,
    p.seqcache = 1 AND p.seqincrement > 0 AND NOT p.seqcycle
FROM `+s.seqName+` s, pg_sequence p WHERE p.seqrelid = $1::text::regclass`, s.seqName).QueryRow(func(row pgx.Row) error {
			var next int64
			if err := row.Scan(&next, &p.usable); err != nil {
				return err
			}
			p.below = min(p.below, next)
			return nil
		})
		// The holders, read after the sequence (a later statement): a
		// transaction that took an id below next took the lock first.
		b.Queue(`WITH l AS MATERIALIZED (SELECT locktype, database, relation, mode, virtualxid, pid FROM pg_locks)
SELECT coalesce(array_agg(DISTINCT v.virtualxid) FILTER (WHERE v.virtualxid IS NOT NULL), '{}'),
    coalesce(bool_or(h.pid IS NULL), false)
FROM l h LEFT JOIN l v ON v.locktype = 'virtualxid' AND v.pid = h.pid
WHERE h.locktype = 'relation' AND h.database = $1 AND h.relation = $2::text::regclass AND h.mode = 'RowExclusiveLock'
    AND h.pid IS DISTINCT FROM pg_backend_pid()`, s.dbOID, s.seqName).QueryRow(func(row pgx.Row) error {
			var prepared bool
			if err := row.Scan(&p.vxids, &prepared); err != nil {
				return err
			}
			switch {
			case !p.usable || p.below <= 0:
				s.proving = nil
			case len(p.vxids) == 0 && !prepared:
				p.state = proofConfirm
			default:
				p.state = proofWaiting
			}
			return nil
		})
	case p.state == proofWaiting:
		// A transaction that keeps its id long (the writer's, or one
		// waiting in a trigger) is checked at longer intervals: 1, 2, 4
		// ... up to claimProofEvery floor reads apart.
		if p.skip > 0 {
			p.skip--
			return
		}
		p.checks++
		p.skip = min(claimProofEvery, 1<<min(p.checks, 8)/2)
		b.Queue(`SELECT NOT EXISTS (SELECT FROM pg_locks l
WHERE l.locktype = 'virtualxid' AND l.virtualxid = ANY($1::text[])
    OR l.locktype = 'relation' AND l.database = $2 AND l.relation = $3::text::regclass AND l.pid IS NULL)`, p.vxids, s.dbOID, s.seqName).QueryRow(func(row pgx.Row) error {
			var ended bool
			if err := row.Scan(&ended); err != nil {
				return err
			}
			if ended {
				p.state = proofConfirm
			}
			return nil
		})
	case p.state == proofConfirm && p.ownFloor:
		// The read that started it gave no floor yet (the claim read
		// again: store.claim): confirm once one has.
	case p.state == proofConfirm:
		// A shard the last proof holds has nothing pending below its C:
		// its descent starts there, past the rows deleted before (which
		// each cost a heap visit until a scan marks them dead).
		from := make([]int64, NumShards)
		for sh := range from {
			from[sh] = math.MinInt64 // the shard's left edge, whatever the ids
			if s.proof.holds(int16(sh)) {
				from[sh] = s.proof.below
			}
		}
		// A relay reading some of the shards (shapeShards) confirms only
		// those: another relay's shards, pending below C while it drains
		// behind, would be descended from their left edge at every
		// confirm, past every row their owner deleted, for a proof this
		// relay never reads them with. Holding fewer shards is as sound.
		shards := `generate_series(0, ` + fmt.Sprint(NumShards-1) + `)`
		args := []any{p.below, from}
		if s.proofShards != nil {
			shards = `unnest($3::int2[])`
			args = append(args, s.proofShards)
		}
		b.Queue(`SELECT coalesce(array_agg(s.shard), '{}') FROM `+shards+` AS s(shard)
WHERE NOT EXISTS (SELECT FROM `+s.outbox+` p
    WHERE p.shard = s.shard AND p.id >= ($2::bigint[])[s.shard + 1] AND p.id < $1::bigint)`, args...).QueryRow(func(row pgx.Row) error {
			var sure []int16
			if err := row.Scan(&sure); err != nil {
				return err
			}
			proof := floorProof{below: p.below}
			for _, sh := range sure {
				proof.sure[sh/64] |= 1 << (sh % 64)
			}
			s.proof, s.proving = proof, nil
			if p.recheck && !proof.holdsAll() {
				// Once more, a floor read on (ownFloor): the shards it
				// holds are not descended again.
				p.recheck, s.proving = false, p
			}
			return nil
		})
	}
}

// descents returns the free shards a floor read must descend, and its
// base: with a proof, the free shards it does not hold, below its C (the
// shards it holds have nothing pending below C, so the floor is the least
// of C and those descents, as with every descent; and C, unlike the base,
// follows the rounds: the read walks past fewer deleted rows); without,
// every free shard, below base.
func (s *store) descents(free []int16, base int64) ([]int16, int64) {
	if s.proof.below == 0 {
		return free, base
	}
	out := make([]int16, 0, len(free))
	for _, sh := range free {
		if !s.proof.holds(sh) {
			out = append(out, sh)
		}
	}
	return out, s.proof.below
}
