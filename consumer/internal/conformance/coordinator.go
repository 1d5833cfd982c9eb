package conformance

import (
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// testShutdownWhileTheCoordinatorLoads stops a consumer while the group's
// coordinator answers every offset commit with COORDINATOR_LOAD_IN_PROGRESS,
// as one that has just moved does while it loads its offsets (on a managed
// cluster, during a broker roll), or answers none of them (a hung broker).
// Run must still return within the shutdown's bounds (the grace, unused
// here, then 10 s for the commit, and for a hung coordinator the leave's
// wait for a request's read timeout): kgoconsumer waited for the fault to
// lift, 43-59 s after the cancel, since franz-go's commits queue behind
// the one retrying and ignore their context while queued (helper 74); an
// orchestrator's grace would have killed it. Hung, it returns in 17.7 s
// (helper 75): the leave waits for the commit in flight. The effects stay once each (the dedup rows), and the
// offsets not committed are delivered again after the restart and skipped.
func testShutdownWhileTheCoordinatorLoads(t *testing.T, a Adapter, hung bool) {
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

	const faultFor = 45 * time.Second
	release := make(chan struct{})
	var once sync.Once
	lift := func() { once.Do(func() { close(release) }) }
	if hung {
		fake.ControlKey(int16(kmsg.OffsetCommit), func(kmsg.Request) (kmsg.Response, error, bool) {
			fake.KeepControl()
			fake.SleepControl(func() {
				select {
				case <-release:
				case <-time.After(faultFor):
				}
			})
			return nil, nil, false
		})
	} else {
		fault := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.OffsetCommit}, Err: kerr.CoordinatorLoadInProgress, Count: -1})
		go func() {
			select {
			case <-release:
			case <-time.After(faultFor):
			}
			fault.Remove()
		}()
	}
	t.Cleanup(lift)
	produce(20, 40)
	waitFor(t, 30*time.Second, "the new messages' effects", func() bool { return e.count(t, "") == 40 })
	time.Sleep(3 * time.Second) // the commits retry (or hang) meanwhile
	start := time.Now()
	r.cancel()
	select {
	case err := <-r.done:
		r.once.Do(func() { r.err = err })
		// The grace is unused (nothing in flight); 10 s for the commit,
		// and when the coordinator hangs up to a request's read timeout
		// (10 s) for the leave.
		bound := 15 * time.Second
		if hung {
			bound = 24 * time.Second
		}
		if took := time.Since(start); took > bound {
			t.Errorf("Run took %s to return after cancel, want %s at most", took.Round(100*time.Millisecond), bound)
		}
	case <-time.After(faultFor + 30*time.Second):
		r.once.Do(func() {})
		t.Fatalf("Run did not return within %s of cancel", faultFor+30*time.Second)
	}
	lift()
	e.exactlyOnce(t, "ledger", 40)
}
