package main

import (
	"regexp"
	"strings"
	"testing"
	"time"
)

// README, "Operations", Logs: "the relay's lines carry `instance=` (its
// `--instance-id`)". Several relays' logs are read side by side (one
// Deployment, one log index), and OnceflowRelayKafkaUnreachable names the
// relay whose log to read. The lines a relay wrote while it waited for
// its database at start (and the broker check's, and the /metrics line)
// carried no instance, so a search by instance found nothing of a relay
// stuck at start. With no --instance-id, every line carries the one
// default the relay registers under. h97.
func TestEveryRelayLogLineCarriesTheInstance(t *testing.T) {
	for name, want := range map[string]string{"given": "relay-h97", "default": ""} {
		t.Run(name, func(t *testing.T) {
			args := []string{"relay",
				"--database-url", "postgres://postgres@127.0.0.1:1/postgres?connect_timeout=1",
				"--brokers", "127.0.0.1:1", "--http-addr", "127.0.0.1:0",
				"--kafka-check-interval", "500ms"}
			if want != "" {
				args = append(args, "--instance-id", want)
			}
			out, _ := runCLITimeout(t, 4*time.Second, args...)
			lines := strings.Split(strings.TrimSpace(out), "\n")
			if len(lines) < 2 {
				t.Fatalf("want the relay's start and wait lines, got:\n%s", out)
			}
			instance := regexp.MustCompile(`(?:^| )instance=(\S+)`)
			for _, l := range lines {
				m := instance.FindStringSubmatch(l)
				switch {
				case m == nil:
					t.Errorf("a relay log line without instance=:\n%s", l)
				case want == "":
					want = m[1]
				case m[1] != want:
					t.Errorf("a relay log line with instance=%s, want %s:\n%s", m[1], want, l)
				}
			}
		})
	}
}
