package main

import (
	"context"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// A relay killed an hour and a half after it started, half an hour ago,
// stays listed (its row is forgotten an hour after its lease lapsed). It is
// not "up 2h" and counting: status says how long it ran and when it was
// last heard of.
func TestStatusSaysHowLongAGoneRelayRanNotThatItIsUp(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	if _, err := pgtest.Pool(t).Exec(context.Background(), `INSERT INTO `+schema+`.relay_instances
    (id, hostname, pid, started_at, heartbeat_at, lease_until, token)
VALUES ('killed', 'old-host', 4242, now() - interval '2 hours', now() - interval '30 minutes', now() - interval '29 minutes', 't'),
       ('running', 'new-host', 4343, now() - interval '10 minutes', now(), now() + interval '1 minute', 'u')`); err != nil {
		t.Fatal(err)
	}
	out, err := runCLI(t, "status", "--database-url", pgtest.URL(t), "--schema", schema)
	if err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	}
	var gone, live string
	for _, line := range strings.Split(out, "\n") {
		switch {
		case strings.Contains(line, "killed"):
			gone = line
		case strings.Contains(line, "running"):
			live = line
		}
	}
	if !strings.Contains(gone, "gone") || strings.Contains(gone, " up ") || !strings.Contains(gone, "ran 1h30m0s") {
		t.Errorf("the gone relay's line: %q, want it gone, not up, having run 1h30m0s", gone)
	}
	if !strings.Contains(live, "live") || !strings.Contains(live, "up 10m") {
		t.Errorf("the live relay's line: %q, want it live and up 10m", live)
	}
}
