package main

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// TestARelayStoppedWhileStartingExitsZero: SIGTERM while the relay waits
// at start (here for an instance id whose row has not lapsed: a restart
// under a fixed id finds its killed predecessor's) is a stop like any
// other: exit 0, as README's exit codes say, not 1 with "first lease
// round: context canceled" (what an orchestrator counts as a crash).
func TestARelayStoppedWhileStartingExitsZero(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary; skipped with -short")
	}
	t.Parallel()
	bin := buildBinary(t)
	schema := pgtest.Schema(t)
	k := kafkatest.New(t)
	if _, err := pgtest.Pool(t).Exec(context.Background(), `INSERT INTO `+schema+`.relay_instances (id, hostname, pid, lease_until, token)
VALUES ('fixed', 'gone-host', 4242, now() + interval '1 hour', 'killed')`); err != nil {
		t.Fatal(err)
	}
	p := startRelayProc(t, bin, relayEnv(t, schema, k), "--instance-id", "fixed", "--log-level", "info")
	waitUntil(t, "the relay to wait for the held instance id", 30*time.Second, func() bool {
		return p.Printed("instance id held by another relay; waiting")
	})
	_ = p.Signal(syscall.SIGTERM)
	err, exited := p.Wait(30 * time.Second)
	if !exited {
		t.Fatalf("the relay did not exit within 30 s of SIGTERM:\n%s", p.Output())
	}
	if err != nil {
		t.Fatalf("exit after SIGTERM while starting: %v, want 0\n%s", err, tailLines(p.Output(), 10))
	}
}
