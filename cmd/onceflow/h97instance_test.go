package main

import (
	"strings"
	"testing"
	"time"
)

// README, "Operations", Logs: "the relay's lines carry `instance=` (its
// `--instance-id`)". Several relays' logs are read side by side (one
// Deployment, one log index), and OnceflowRelayKafkaUnreachable names the
// relay whose log to read. The lines a relay writes while it waits for
// its database at start (and the broker check's, and the /metrics line)
// carry no instance, so a search by instance finds nothing of a relay
// stuck at start. h97.
func TestEveryRelayLogLineCarriesTheInstance(t *testing.T) {
	out, _ := runCLITimeout(t, 4*time.Second, "relay",
		"--database-url", "postgres://postgres@127.0.0.1:1/postgres?connect_timeout=1",
		"--brokers", "127.0.0.1:1", "--instance-id", "relay-h97", "--http-addr", "127.0.0.1:0",
		"--kafka-check-interval", "500ms")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) < 2 {
		t.Fatalf("want the relay's start and wait lines, got:\n%s", out)
	}
	for _, l := range lines {
		if !strings.Contains(l, "instance=relay-h97") {
			t.Errorf("a relay log line without instance=relay-h97:\n%s", l)
		}
	}
}
