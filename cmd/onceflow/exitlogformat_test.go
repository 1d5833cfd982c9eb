package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// Under --log-format json the relay's last words, the error it exits with,
// came as a plain "onceflow: ..." line after its JSON lines: a log
// pipeline parsing the container's stderr as JSON dropped exactly the line
// that says why the relay died. Here the relay exits at once (its schema
// has no migrations), and a usage error of an admin command, also under
// json, keeps its exit code 2. Under text the line stays as it was.
func TestTheExitLineFollowsTheLogFormat(t *testing.T) {
	url := pgtest.URL(t)
	schema := pgtest.Schema(t)
	absent := schema + "_absent" // never migrated: the relay refuses to start
	t.Setenv("ONCEFLOW_DATABASE_URL", "")
	t.Setenv("ONCEFLOW_LOG_FORMAT", "")
	for _, tc := range []struct {
		name     string
		args     []string
		wantCode int
		json     bool
	}{
		{"relay json", []string{"relay", "--database-url", url, "--schema", absent, "--brokers", "127.0.0.1:1", "--log-format", "json"}, 1, true},
		{"relay text", []string{"relay", "--database-url", url, "--schema", absent, "--brokers", "127.0.0.1:1"}, 1, false},
		{"usage json", []string{"status", "--schema", schema, "--log-format", "json", "--database-url", ""}, 2, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			var out, errOut bytes.Buffer
			code := exitCode(run(ctx, tc.args, &out, &errOut), &errOut)
			if code != tc.wantCode {
				t.Fatalf("exit code %d, want %d; stderr:\n%s", code, tc.wantCode, errOut.String())
			}
			lines := strings.Split(strings.TrimSpace(errOut.String()), "\n")
			last := lines[len(lines)-1]
			if !tc.json {
				if !strings.HasPrefix(last, "onceflow: ") {
					t.Fatalf("under text the last line is %q, want the plain \"onceflow: ...\" line", last)
				}
				return
			}
			for _, l := range lines {
				var m map[string]any
				if err := json.Unmarshal([]byte(l), &m); err != nil {
					t.Errorf("--log-format json, but stderr has a line that is not JSON: %q", l)
				}
			}
			var m map[string]any
			if err := json.Unmarshal([]byte(last), &m); err == nil {
				if m["level"] != "ERROR" || m["error"] == nil || m["error"] == "" {
					t.Errorf("the last line is %q: want an ERROR line with the error", last)
				}
			}
		})
	}
}
