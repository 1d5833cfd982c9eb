package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/consumer"
)

// rebalanceMessage is a message of a random rebalance run: its id and key
// (empty: keyless), whether it is poison, and how long its handler takes
// on its first slowRuns runs (then it is quick, so that rounds get past
// it), honouring its context or ignoring it.
type rebalanceMessage struct {
	id, key       string
	poison        bool
	slow          time.Duration
	slowRuns      int32
	ignoresCancel bool
}

// Repeated rebalances, in each mode (in order, key-parallel at Concurrency
// 4, batches of up to 8), against real PostgreSQL. Each round starts a
// partition at the offset after the last one marked done (the committed
// offset, where the partition's next owner starts), lets it run 0–40ms
// and stops it with a 0–20ms grace. A tenth of the handlers are slow
// (5–30ms) on their first two runs, half of them honouring their cancelled
// context and half ignoring it; one ignores it on its first run for longer
// than Stop waits (half a second after the cancel), so Stop abandons it
// and closes its connection. A twentieth of the messages are poison
// (dead-lettered), an eighth re-send an earlier id. Whatever a stop cuts
// short:
//   - no MarkDone comes after Stop returned, and none passes an offset
//     that was unfinished at that moment (neither its id's effect
//     committed nor dead-lettered);
//   - each id has exactly one effect, none if every copy was poison, and
//     only poison copies are dead-lettered;
//   - every id with a good copy is applied: after 60 rounds, one last
//     round runs until every offset is marked.
//
// Each seed fixes the plan and the rounds' timings, so a failing seed
// replays them (the interleaving varies). ONCEFLOW_RANDOM_SEEDS runs more.
func TestRandomRebalancesNeverMarkUnfinishedAndApplyEachIDOnce(t *testing.T) {
	modes := []struct {
		name        string
		concurrency int
		batch       bool
	}{
		{"in order", 1, false},
		{"key-parallel", 4, false},
		{"batch", 1, true},
	}
	for _, m := range modes {
		for seed := range randomSeeds(4) {
			t.Run(fmt.Sprintf("%s seed %d", m.name, seed), func(t *testing.T) {
				randomRebalances(t, m.concurrency, m.batch, seed)
			})
		}
	}
}

func randomRebalances(t *testing.T, concurrency int, batch bool, seed uint64) {
	b := setup(t)
	const n, keys, rounds = 300, 12, 60
	rng := rand.New(rand.NewPCG(seed, 0x4eba1))
	plan := make([]rebalanceMessage, n)
	msgs := make([]consumer.Message, n)
	ids := make([]string, n)
	copies := map[string]int{}
	for o := range plan {
		var rm rebalanceMessage
		rm.id, rm.key = randomIDKey(rng, o, keys, func(i int) (string, string) { return plan[i].id, plan[i].key })
		rm.poison = rng.IntN(20) == 0
		if rng.IntN(10) == 0 {
			rm.slow, rm.slowRuns, rm.ignoresCancel = time.Duration(5+rng.IntN(26))*time.Millisecond, 2, rng.IntN(2) == 0
		}
		plan[o], ids[o] = rm, rm.id
		copies[rm.id]++
	}
	// The stuck message: a good one whose id has no other copy, so its
	// handler surely runs; among the first tenth, so that it is reached in
	// the short rounds, which stop it, even when a loaded machine leaves
	// most of the offsets to the last, long round.
	stuck := rng.IntN(n / 10)
	for plan[stuck].poison || copies[plan[stuck].id] > 1 {
		stuck = (stuck + 1) % n
	}
	plan[stuck].slow, plan[stuck].slowRuns, plan[stuck].ignoresCancel = 800*time.Millisecond, 1, true
	for o, rm := range plan {
		msgs[o] = msg(int64(o), rm.id, rm.key)
	}

	runs := make([]atomic.Int32, n)
	var running, cancelIgnored atomic.Int32
	handle := func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		running.Add(1)
		defer running.Add(-1)
		rm := plan[m.Offset]
		if runs[m.Offset].Add(1) <= rm.slowRuns {
			if rm.ignoresCancel {
				time.Sleep(rm.slow) // a call that takes no context
				if ctx.Err() != nil {
					cancelIgnored.Add(1)
				}
			} else {
				select {
				case <-time.After(rm.slow):
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		}
		if rm.poison {
			return errors.New("poison: malformed payload")
		}
		return b.record(ctx, tx, "ledger", m)
	}
	pool := ownPool(t, func(c *pgxpool.Config) { c.MaxConns = 6 })
	cfg := &consumer.Config{Schema: b.schema, Concurrency: concurrency, BatchSize: 8, MaxAttempts: 2,
		MinBackoff: time.Millisecond, MaxBackoff: 2 * time.Millisecond}
	p := newLedgerProcessor(t, pool, batch, handle, cfg)

	bad := &violations{}
	marks := newMarkAudit(b, ids, bad)
	ctx := context.Background()
	round := 0
	for ; marks.committed() < n-1; round++ {
		last := round == rounds
		tr := &auditTransport{audit: marks}
		w := p.StartPartition(ctx, tr)
		if err := w.Add(ctx, msgs[marks.committed()+1:]...); err != nil {
			w.Stop(canceled())
			t.Fatal(err)
		}
		if !last {
			time.Sleep(time.Duration(rng.IntN(41)) * time.Millisecond)
		} else {
			deadline := time.Now().Add(30 * time.Second)
			for marks.committed() < n-1 && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
		}
		grace, cancel := context.WithTimeout(ctx, time.Duration(rng.IntN(21))*time.Millisecond)
		w.Stop(grace)
		cancel()
		tr.stopped.Store(true)
		if last {
			break
		}
	}
	// Handlers Stop abandoned run on; let them end, with their connections.
	waitFor(t, 10*time.Second, "abandoned handlers to return", func() bool {
		return running.Load() == 0 && pool.Stat().AcquiredConns() == 0
	})
	bad.report(t)
	if got := marks.committed(); got != n-1 {
		t.Fatalf("last offset marked done = %d after %d rounds, the last one 30s long; want %d", got, round+1, n-1)
	}

	checkOneEffectPerID(t, b, ids, func(o int) bool { return plan[o].poison })
	for _, o := range marks.deadOffsets() {
		if !plan[o].poison {
			t.Errorf("offset %d (id %s) dead-lettered; only poison copies should be", o, plan[o].id)
		}
	}
	applied := len(effectsByID(t, b))
	if got := b.processedRows(t, "ledger"); got != applied {
		t.Errorf("dedup records = %d, want %d", got, applied)
	}
	if round < 3 {
		t.Errorf("all %d offsets marked within %d rounds: the test exercised few rebalances", n, round+1)
	}
	if cancelIgnored.Load() == 0 {
		t.Error("no handler ran on after its context was cancelled: the test exercised nothing of that")
	}
}
