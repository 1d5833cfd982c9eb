package relay_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// Run must end every goroutine it started (the lease loop, the publish
// loop, side retries, the probe) by the time it returns: an embedding
// service restarts a relay after an error, and a leak there grows for the
// process's life.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, append(pgtest.LeakIgnores(),
		// kfake's own loop can outlast its Close by a moment while a
		// delayed (slept) fault finishes; it is the fake broker's, not ours.
		goleak.IgnoreAnyFunction("github.com/twmb/franz-go/pkg/kfake.(*Cluster).run"),
		// A control function kfake runs in a goroutine of its own, still
		// taking the cluster's lock as Close returns (seen once in CI).
		goleak.IgnoreAnyFunction("github.com/twmb/franz-go/pkg/kfake.(*Cluster).runControl.func1"),
	)...)
}
