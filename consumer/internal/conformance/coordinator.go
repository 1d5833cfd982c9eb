package conformance

import (
	"strconv"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// testShutdownWhileTheCoordinatorLoads stops a consumer while the group's
// coordinator answers every offset commit with COORDINATOR_LOAD_IN_PROGRESS,
// as one that has just moved does while it loads its offsets (on a managed
// cluster, during a broker roll). Run must still return within the
// shutdown's bounds (the grace, then one bounded commit): kgoconsumer
// waited for the fault to lift, 59 s after the cancel, since franz-go's
// commits queue behind the one retrying and ignore their context while
// queued (helper 74). An orchestrator's grace would have killed it. The
// effects stay once each (the dedup rows), and the offsets not committed
// are delivered again after the restart and skipped.
func testShutdownWhileTheCoordinatorLoads(t *testing.T, a Adapter) {
	e := setup(t, a)
	fake := e.k.RequireFake(t)
	topic := e.k.Topic(t, 1)
	produce := func(from, to int) {
		var batch []rec
		for i := from; i < to; i++ {
			batch = append(batch, rec{id: "id-" + strconv.Itoa(i), value: "v"})
		}
		e.produce(t, topic, batch...)
	}
	produce(0, 20)
	r := e.startWith(t, e.processor(t, "ledger", nil), Options{}, "g", topic)
	e.waitCommitted(t, "g", topic, 30*time.Second)

	const loadFor = 45 * time.Second
	fault := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.OffsetCommit}, Err: kerr.CoordinatorLoadInProgress, Count: -1})
	lift := time.AfterFunc(loadFor, fault.Remove)
	t.Cleanup(func() { lift.Stop(); fault.Remove() })
	produce(20, 40)
	waitFor(t, 30*time.Second, "the new messages' effects", func() bool { return e.count(t, "") == 40 })
	time.Sleep(3 * time.Second) // the commits retry meanwhile
	start := time.Now()
	r.cancel()
	select {
	case err := <-r.done:
		r.once.Do(func() { r.err = err })
		if took := time.Since(start); took > 20*time.Second {
			t.Errorf("Run took %s to return after cancel, want the shutdown's grace (5 s) and its commit's bound (10 s)", took.Round(100*time.Millisecond))
		}
	case <-time.After(loadFor + 30*time.Second):
		r.once.Do(func() {})
		t.Fatalf("Run did not return within %s of cancel", loadFor+30*time.Second)
	}
	e.exactlyOnce(t, "ledger", 40)
}
