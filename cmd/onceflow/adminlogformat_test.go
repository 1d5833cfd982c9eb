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
// shells. With ONCEFLOW_LOG_FORMAT=json these commands still wrote their
// diagnostics (the unknown-variable warning README documents) as plain
// "onceflow: warning: ..." lines: the flag was accepted and did nothing,
// and a log pipeline that parses the Job's stderr as JSON dropped them.
// h97. A usage error (the mistyped variable's doing) still comes with the
// warning, and --log-level error leaves it out.
func TestAdminCommandsHonourLogFormatJSON(t *testing.T) {
	t.Setenv("ONCEFLOW_HTTP_ADRR", ":9090")
	schema := pgtest.Schema(t)
	url := pgtest.URL(t)
	for _, tc := range []struct {
		name    string
		env     string // ONCEFLOW_LOG_FORMAT
		args    []string
		wantErr bool
	}{
		{"status flag", "", []string{"status", "--database-url", url, "--schema", schema, "--log-format", "json"}, false},
		{"dead list env", "json", []string{"dead", "list", "--database-url", url, "--schema", schema}, false},
		{"migrate status env", "json", []string{"migrate", "status", "--database-url", url, "--schema", schema}, false},
		{"migrate print env", "json", []string{"migrate", "print", "--version", "1"}, false},
		{"usage error", "", []string{"status", "--schema", schema, "--log-format", "json", "--database-url", ""}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("ONCEFLOW_LOG_FORMAT", tc.env)
			t.Setenv("ONCEFLOW_DATABASE_URL", "")
			var out, errOut bytes.Buffer
			if err := run(context.Background(), tc.args, &out, &errOut); (err != nil) != tc.wantErr {
				t.Fatalf("err %v, want an error: %v", err, tc.wantErr)
			}
			lines := strings.Split(strings.TrimSpace(errOut.String()), "\n")
			if len(lines) == 0 || lines[0] == "" {
				t.Fatal("no warning on stderr for ONCEFLOW_HTTP_ADRR")
			}
			for _, l := range lines {
				var m map[string]any
				if err := json.Unmarshal([]byte(l), &m); err != nil {
					t.Errorf("--log-format json, but stderr has a line that is not JSON: %q", l)
				} else if m["level"] != "WARN" || !strings.Contains(m["msg"].(string), "ONCEFLOW_HTTP_ADRR") {
					t.Errorf("want the warning at WARN, got %q", l)
				}
			}
		})
	}
	t.Run("log level error", func(t *testing.T) {
		var out, errOut bytes.Buffer
		if err := run(context.Background(), []string{"status", "--database-url", url, "--schema", schema, "--log-level", "error"}, &out, &errOut); err != nil {
			t.Fatal(err)
		}
		if errOut.Len() != 0 {
			t.Errorf("--log-level error, but stderr has %q", errOut.String())
		}
	})
}
