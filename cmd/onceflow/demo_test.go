package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// The README's first command: the demo runs end to end against the test
// database and its report passes.
func TestDemoRunsEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the demo's processes; skipped with -short")
	}
	t.Parallel()
	bin := buildBinary(t)
	schema := pgtest.EmptySchema(t)
	cmd := exec.Command(bin, "demo", "--payments", "4000", "--accounts", "40", "--schema", schema)
	cmd.Env = append(os.Environ(), "ONCEFLOW_DATABASE_URL="+pgtest.URL(t), "ONCEFLOW_BROKERS=")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("demo: %v\n%s", err, out)
	}
	for _, want := range []string{"started an embedded Kafka", "SIGKILLed relay-a", "SIGKILLed a consumer", "re-inserted", "effectively once"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(string(out), "FAIL") {
		t.Errorf("a demo check failed:\n%s", out)
	}
}
