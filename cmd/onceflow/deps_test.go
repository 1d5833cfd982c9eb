package main

import (
	"os/exec"
	"strings"
	"testing"
)

// The binary that runs relays in production links no test helper and no
// Docker client: container scanners would flag them, and they do not belong
// in a relay.
func TestBinaryLinksNoTestHelpersOrDocker(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	for _, pkg := range strings.Fields(string(out)) {
		for _, banned := range []string{"testcontainers", "docker", "moby", "/internal/pgtest", "/internal/kafkatest", "/internal/proctest"} {
			if strings.Contains(pkg, banned) {
				t.Errorf("cmd/onceflow links %s", pkg)
			}
		}
	}
}
