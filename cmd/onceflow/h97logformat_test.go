package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// `onceflow status --help` (and migrate's, dead's) offers --log-format
// "text or json (env ONCEFLOW_LOG_FORMAT)", and envnames.go says one
// environment is often shared by a relay, its migration job and operators'
// shells. With ONCEFLOW_LOG_FORMAT=json these commands still write their
// diagnostics (the unknown-variable warning README documents) as plain
// "onceflow: warning: ..." lines: the flag is accepted and does nothing,
// and a log pipeline that parses the Job's stderr as JSON drops them. h97.
func TestAdminCommandsHonourLogFormatJSON(t *testing.T) {
	t.Setenv("ONCEFLOW_HTTP_ADRR", ":9090")
	schema := pgtest.Schema(t)
	var out, errOut bytes.Buffer
	if err := run(context.Background(), []string{"status", "--database-url", pgtest.URL(t), "--schema", schema, "--log-format", "json"}, &out, &errOut); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(errOut.String()), "\n")
	if len(lines) == 0 || lines[0] == "" {
		t.Fatal("no warning on stderr for ONCEFLOW_HTTP_ADRR")
	}
	for _, l := range lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Errorf("--log-format json, but stderr has a line that is not JSON: %q", l)
		}
	}
}
