package kgopublisher_test

import (
	"testing"

	"go.uber.org/goleak"
)

// A publisher's Close must end every goroutine its client started: a relay
// replaces its publisher after some failures, and a leak there grows for
// the process's life.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// kfake's own loop can outlast its Close by a moment while a
		// delayed (slept) fault finishes; it is the fake broker's, not ours.
		goleak.IgnoreAnyFunction("github.com/twmb/franz-go/pkg/kfake.(*Cluster).run"),
		// A control function kfake runs in a goroutine of its own, still
		// taking the cluster's lock as Close returns (seen once in CI).
		goleak.IgnoreAnyFunction("github.com/twmb/franz-go/pkg/kfake.(*Cluster).runControl.func1"),
	)
}
