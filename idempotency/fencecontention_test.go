package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/idempotency"
)

// errRunFailed is the error of a run that fails (the gateway said no).
var errRunFailed = errors.New("gateway declined")

// fenceRun is one planned run of a key: how long its work takes and
// whether it fails.
type fenceRun struct {
	work time.Duration
	fail bool
}

// contendedKey is what the test sees of one key: the runs that are in fn
// now (never more than one), the runs started and succeeded, and the
// result of the run that succeeded.
type contendedKey struct {
	plan      []fenceRun
	inFn      atomic.Int32
	started   atomic.Int32
	succeeded atomic.Int32
	overlaps  atomic.Int32
	result    atomic.Value // string
}

// Fence.Do under contention: 30 callers on each of 10 keys call Do until
// they get the key's result, retrying after ErrInProgress and after a run
// that failed, with 0–50ms pauses. The lease is 300ms and a run works
// 0–500ms (honouring its context), so long runs live on lease renewals
// (every 100ms); a third of runs fail, which releases the claim, and the
// next caller runs the key again. Checks, per key: two runs never overlap
// (a run starts only once the previous one returned), exactly one run
// succeeds, and every caller ends with that run's result; and some run
// that outlived its lease succeeded, so renewals were exercised.
//
// Three seeds run one after the other, for more handovers (a failed run,
// then another caller's) than one seed's few. Each seed fixes every key's
// runs (work and failure, in the order they start) and the callers'
// pauses. ONCEFLOW_RANDOM_SEEDS runs another number of seeds.
func TestFenceDoUnderContentionNeverOverlapsAndSucceedsOncePerKey(t *testing.T) {
	t.Parallel()
	seeds := uint64(3)
	if n, err := strconv.Atoi(os.Getenv("ONCEFLOW_RANDOM_SEEDS")); err == nil && n > 0 {
		seeds = uint64(n)
	}
	for seed := range seeds {
		t.Run(fmt.Sprintf("seed %d", seed), func(t *testing.T) { fenceUnderContention(t, seed) })
	}
}

func fenceUnderContention(t *testing.T, seed uint64) {
	b := setup(t)
	// The lease leaves renewals (every lease/3) room for a loaded machine
	// under -race: at 300 ms a CI run lost the long run's lease, and with
	// it the renewal this test must exercise; at 1 s a CI run on a machine
	// at a third of its speed did too (a renewal waited over 667 ms beside
	// 300 callers' attempts).
	const nKeys, callers, lease = 10, 30, 2 * time.Second
	f := newFence(t, b, idempotency.FenceConfig{Lease: lease})
	rng := rand.New(rand.NewPCG(seed, 0xfe9ce))
	keys := make([]*contendedKey, nKeys)
	for k := range keys {
		// More runs than a key can need: each fails with probability
		// 1/3, so 100 in a row would.
		keys[k] = &contendedKey{plan: make([]fenceRun, 100)}
		for r := range keys[k].plan {
			keys[k].plan[r] = fenceRun{work: time.Duration(rng.IntN(501)) * time.Millisecond, fail: rng.IntN(3) == 0}
		}
	}
	// Whatever the seed, one key's first run outlives its lease and
	// succeeds: it holds the key on renewals alone.
	keys[0].plan[0] = fenceRun{work: lease + lease/2}
	var longSucceeded, leaseLost atomic.Int32
	results := make([][]string, nKeys)
	var wg sync.WaitGroup
	for k, ks := range keys {
		key := fmt.Sprintf("charge-%d", k)
		results[k] = make([]string, callers)
		fn := func(ctx context.Context) ([]byte, error) {
			if ks.inFn.Add(1) != 1 {
				ks.overlaps.Add(1)
			}
			defer ks.inFn.Add(-1)
			r := int(ks.started.Add(1)) - 1
			if r >= len(ks.plan) {
				return nil, fmt.Errorf("run %d of %s: beyond the plan", r, key)
			}
			run := ks.plan[r]
			select {
			case <-time.After(run.work):
			case <-ctx.Done():
				return nil, context.Cause(ctx)
			}
			if run.fail {
				return nil, errRunFailed
			}
			ks.succeeded.Add(1)
			if run.work > lease {
				longSucceeded.Add(1)
			}
			res := fmt.Sprintf("%s receipt %d", key, r)
			ks.result.Store(res)
			return []byte(res), nil
		}
		for c := range callers {
			pauses := rand.New(rand.NewPCG(seed, uint64(k*callers+c)))
			wg.Add(1)
			go func() {
				defer wg.Done()
				deadline := time.Now().Add(60 * time.Second)
				for {
					got, err := f.Do(context.Background(), key, fn)
					switch {
					case err == nil:
						results[k][c] = string(got)
						return
					case errors.Is(err, idempotency.ErrLeaseLost):
						leaseLost.Add(1)
					case !errors.Is(err, idempotency.ErrInProgress) && !errors.Is(err, errRunFailed):
						t.Errorf("caller %d of %s: %v", c, key, err)
						return
					}
					if time.Now().After(deadline) {
						t.Errorf("caller %d of %s: no result after 60s", c, key)
						return
					}
					time.Sleep(time.Duration(pauses.IntN(51)) * time.Millisecond)
				}
			}()
		}
	}
	wg.Wait()

	for k, ks := range keys {
		key := fmt.Sprintf("charge-%d", k)
		if n := ks.overlaps.Load(); n > 0 {
			t.Errorf("%s: %d runs started while another run of the key was in fn", key, n)
		}
		if n := ks.succeeded.Load(); n != 1 {
			t.Errorf("%s: %d runs succeeded (of %d), want exactly 1", key, n, ks.started.Load())
			continue
		}
		want, _ := ks.result.Load().(string)
		for c, got := range results[k] {
			if got != want && got != "" { // "" : the caller failed, reported above
				t.Errorf("%s: caller %d got %q, want the successful run's %q", key, c, got, want)
			}
		}
	}
	var done int
	if err := b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()+
		` WHERE state = 'done'`).Scan(&done); err != nil {
		t.Fatal(err)
	}
	if done != nKeys {
		t.Errorf("%d keys stored done, want %d", done, nKeys)
	}
	if longSucceeded.Load() == 0 {
		t.Error("no run longer than the lease succeeded: the test exercised no lease renewal")
	}
	if n := leaseLost.Load(); n > 0 {
		t.Logf("%d runs lost their lease and were retried", n)
	}
}
