package relay_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Run must end every goroutine it started (the lease loop, the publish
// loop, side retries, the probe) by the time it returns: an embedding
// service restarts a relay after an error, and a leak there grows for the
// process's life.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// The shared test pool's health check and its connections'
		// background readers outlive the tests by design.
		goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
		goleak.IgnoreAnyFunction("github.com/jackc/pgx/v5/pgconn/internal/bgreader.(*BGReader).bgRead"),
		goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).triggerHealthCheck.func1"),
		goleak.IgnoreAnyFunction("github.com/jackc/puddle/v2.(*Pool[...]).acquire"),
		// kfake's own loop can outlast its Close by a moment while a
		// delayed (slept) fault finishes; it is the fake broker's, not ours.
		goleak.IgnoreAnyFunction("github.com/twmb/franz-go/pkg/kfake.(*Cluster).run"),
	)
}
