package relay

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// Randomized claims against real PostgreSQL, driven as the relay drives
// them: a round read ahead while the last one is with Kafka (its ids left
// out), the round before it landing (its ids left out until deleted),
// failures that block a key from its failed event until a due retry (and
// keyless events left out by id), the read-ahead losing the events of keys
// that just failed, holds dropped when a due retry is not read
// (forgetLostRetries), a stuck key, late commits, shards lost and regained,
// and byte bounds: "none", "guarded" (values above a round's share:
// withheld and read again exactly) and "toggle" (some near the bound).
// Every claim must be each key's pending events' prefix, past no blocked
// key's hold, of owned shards only; at the end everything drains (G2, G3).
// The "none" runs must take the held read (one relay's read of every
// shard that drops blocked keys' events itself): a claim that keeps such
// an event fails them at once. ONCEFLOW_RANDOM_SEEDS runs more seeds per
// mode (default 3). Written by a cold review (helper 34).
func TestRandomizedClaimsAsTheRelayMakesThem(t *testing.T) {
	seeds := 3
	if n, err := strconv.Atoi(os.Getenv("ONCEFLOW_RANDOM_SEEDS")); err == nil && n > 0 {
		seeds = n
	}
	var heldReads atomic.Int64
	t.Run("modes", func(t *testing.T) {
		for _, mode := range []string{"none", "guarded", "toggle"} {
			for seed := range seeds {
				t.Run(fmt.Sprintf("%s seed %d", mode, seed), func(t *testing.T) {
					t.Parallel()
					n := randomRelayClaims(t, mode, int64(seed))
					if mode == "none" {
						heldReads.Add(n)
					}
				})
			}
		}
	})
	if !t.Failed() && heldReads.Load() == 0 {
		t.Fatal(`no claim of the "none" runs took the held read: the test no longer reaches it`)
	}
}

// randomRelayClaims runs one seed and returns how many held reads its
// claims sent.
func randomRelayClaims(t *testing.T, mode string, seed int64) (heldReads int64) {
	rng := rand.New(rand.NewPCG(uint64(seed), 77))
	ctx := context.Background()
	schema := pgtest.Schema(t)
	var held atomic.Int64
	// The held reads (claimHeldSQL: one relay's read of every shard with
	// each row's shard) its claims send; late commits hold their
	// connections across rounds.
	pool := pgtest.TracedPool(t, StatementTracer{See: func(sql string, _ []any) {
		if strings.Contains(sql, claimColumns+`, o.shard`) {
			held.Add(1)
		}
	}}, 32)
	st := newStore(pool, schema)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	hot := []byte{shardOf("stuck"), shardOf("hot-a")}
	var keys []string
	for _, sh := range hot {
		keys = append(keys, keysInShard(sh, 5, "")...)
	}
	keys = append(keys, keysOutside(25, hot...)...)
	const limit = 50
	size := func() int { return 1 }
	switch mode {
	case "guarded":
		st.maxBytes = 200_000 // a round's share 4,000
		size = func() int {
			if rng.IntN(10) == 0 {
				return 4_500 + rng.IntN(3000)
			}
			return 1
		}
	case "toggle":
		st.maxBytes = 100_000 // a round's share 2,000
		size = func() int {
			switch rng.IntN(60) {
			case 0:
				return 2_500 + rng.IntN(5_000)
			case 1:
				return 60_000 + rng.IntN(50_000)
			}
			return 1 + rng.IntN(100)
		}
	}
	// keys[0] is stuck while writers write; in two seeds of three it gets
	// no events after the first backlog (a cold stuck key).
	coldStuck := false
	insert := func(db execer, n int) {
		batch, sizes := make([][]byte, n), make([]int32, n)
		for i := range n {
			if rng.IntN(15) > 0 {
				batch[i] = []byte(keys[rng.IntN(len(keys))])
				if coldStuck && string(batch[i]) == keys[0] {
					batch[i] = []byte(keys[1+rng.IntN(len(keys)-1)])
				}
			}
			sizes[i] = int32(size())
		}
		if _, err := db.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 't', k, decode(repeat('00', s), 'hex') FROM unnest($1::bytea[], $2::int4[]) WITH ORDINALITY AS x(k, s, n) ORDER BY n`, batch, sizes); err != nil {
			t.Fatal(err)
		}
	}
	insert(st.pool, 2500)
	coldStuck = seed%3 != 2
	type late struct {
		tx     pgx.Tx
		commit int
	}
	type block struct {
		first   int64
		retryAt int
	}
	var lates []late
	// A failed run leaves late transactions open: end them before the
	// pool closes (cleanups run last first), which waits for their
	// connections.
	t.Cleanup(func() {
		for _, l := range lates {
			_ = l.tx.Rollback(context.Background())
		}
	})
	blocked := map[string]*block{}    // by key
	keylessBlocked := map[int64]int{} // id: the round its retry is due
	var inFlight []pendingEvent       // the round with Kafka
	var finishing []int64             // the round being recorded
	shards := everyShard()
	const writeRounds = 200
	failP := 0.004
	if seed%2 == 1 {
		failP = 0.015
	}
	empty := 0
	st.lastFull = true
	for round := 0; round < 15_000; round++ {
		if round < writeRounds {
			insert(st.pool, 20+rng.IntN(40))
			if rng.IntN(5) == 0 {
				tx, err := st.pool.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				insert(tx, 1+rng.IntN(5))
				lates = append(lates, late{tx, round + 1 + rng.IntN(6)})
			}
			if rng.IntN(60) == 0 { // lose two shards (one hot), or regain them
				if len(shards) == NumShards {
					out := []int16{int16(rng.IntN(NumShards)), int16(hot[rng.IntN(2)])}
					shards = slices.DeleteFunc(everyShard(), func(sh int16) bool { return slices.Contains(out, sh) })
				} else {
					shards = everyShard()
				}
			}
		} else {
			shards = everyShard()
			failP = 0
		}
		for i := 0; i < len(lates); i++ {
			if lates[i].commit <= round || round >= writeRounds {
				if err := lates[i].tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				lates = slices.Delete(lates, i, i+1)
				i--
			}
		}
		var bl []keyBlock
		for k, b := range blocked {
			from := b.first
			if round >= b.retryAt {
				from++ // due: its failed event may be read again
			}
			bl = append(bl, keyBlock{key: []byte(k), firstID: from})
		}
		slices.SortFunc(bl, func(a, b keyBlock) int { return slices.Compare(a.key, b.key) })
		var excluded []int64
		for i := range inFlight {
			excluded = append(excluded, inFlight[i].id)
		}
		excluded = append(excluded, finishing...)
		for id, at := range keylessBlocked {
			if round < at {
				excluded = append(excluded, id)
			}
		}
		pending := keyPending(t, st, outbox, excluded)
		events, err := st.claim(ctx, "me", shards, limit, bl, slices.Clone(excluded))
		if err != nil {
			t.Fatal(err)
		}
		checkPrefixRound(t, fmt.Sprintf("round %d", round), events, pending, bl)
		for i := range events {
			if sh := int16(eventHash(&events[i])[0]); !slices.Contains(shards, sh) {
				t.Fatalf("round %d read event %d of shard %d, not owned", round, events[i].id, sh)
			}
			if slices.Contains(excluded, events[i].id) {
				t.Fatalf("round %d read event %d, left out", round, events[i].id)
			}
		}
		// A due retry not read drops its hold (forgetLostRetries).
		read := map[string]bool{}
		for i := range events {
			if events[i].key != nil {
				read[string(events[i].key)] = true
			}
		}
		for k, b := range blocked {
			if round >= b.retryAt && !read[k] && !slices.Contains(excluded, b.first) {
				delete(blocked, k)
			}
		}
		// The round being recorded lands.
		if len(finishing) > 0 {
			if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, finishing); err != nil {
				t.Fatal(err)
			}
			finishing = nil
		}
		// The round with Kafka: its outcome.
		failedKeys := map[string]bool{}
		for i := range inFlight {
			e := &inFlight[i]
			if e.key == nil {
				if rng.Float64() < failP {
					keylessBlocked[e.id] = round + 1 + rng.IntN(4)
					continue
				}
				delete(keylessBlocked, e.id)
				finishing = append(finishing, e.id)
				continue
			}
			k := string(e.key)
			if failedKeys[k] {
				continue
			}
			if rng.Float64() < failP || k == keys[0] && round < writeRounds {
				failedKeys[k] = true
				blocked[k] = &block{first: e.id, retryAt: round + 1 + rng.IntN(5)}
				continue
			}
			if b := blocked[k]; b != nil && b.first == e.id {
				delete(blocked, k)
			}
			finishing = append(finishing, e.id)
		}
		// The round read ahead goes next, less the events of the keys that
		// just failed and of those still waiting.
		next := events[:0:0]
		for i := range events {
			e := &events[i]
			if e.key != nil && failedKeys[string(e.key)] {
				continue
			}
			if e.key != nil {
				if b := blocked[string(e.key)]; b != nil && round+1 < b.retryAt && e.id >= b.first {
					continue
				}
			}
			next = append(next, *e)
		}
		inFlight = next
		if round <= writeRounds || len(events) > 0 || len(inFlight) > 0 || len(finishing) > 0 {
			empty = 0
			continue
		}
		if empty++; empty <= 3 {
			continue
		}
		var left int
		if err := st.pool.QueryRow(ctx, `SELECT count(*) FROM `+outbox).Scan(&left); err != nil {
			t.Fatal(err)
		}
		if left > 0 {
			t.Fatalf("round %d: %d events left pending while claims read nothing (blocked %v, keyless %v) (G2)", round, left, blocked, keylessBlocked)
		}
		t.Logf("drained at round %d; %d held reads", round, held.Load())
		return held.Load()
	}
	t.Fatal("not drained in 15,000 rounds")
	return 0
}
