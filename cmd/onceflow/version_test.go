package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// `onceflow version` and `--version` print the module version and the VCS
// revision the binary was built from, as the go command recorded them.
func TestVersionPrintsModuleVersionAndRevision(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary; skipped with -short")
	}
	t.Parallel()
	head, err := exec.Command("git", "rev-parse", "HEAD").Output()
	if err != nil {
		t.Fatalf("git rev-parse HEAD: %v (the test needs the repository's git history)", err)
	}
	bin := filepath.Join(t.TempDir(), "onceflow")
	if out, err := exec.Command("go", "build", "-buildvcs=true", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	meta, err := exec.Command("go", "version", "-m", bin).Output()
	if err != nil {
		t.Fatal(err)
	}
	var version string
	for _, line := range strings.Split(string(meta), "\n") {
		if f := strings.Fields(line); len(f) >= 3 && f[0] == "mod" && f[1] == "github.com/onceflow/onceflow" {
			version = f[2]
		}
	}
	want := []string{"onceflow " + version + " ", runtime.Version()}
	// The go command stamps the revision in a clone, not in a git worktree
	// (whose .git is a file): there only the version can be checked.
	top, _ := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if fi, err := os.Stat(filepath.Join(strings.TrimSpace(string(top)), ".git")); err == nil && fi.IsDir() {
		want = append(want, "(revision "+strings.TrimSpace(string(head)))
	} else {
		t.Logf("a git worktree: the go command stamps no revision here; checking the version only")
	}
	for _, arg := range []string{"version", "--version"} {
		out, err := exec.Command(bin, arg).CombinedOutput()
		if err != nil {
			t.Fatalf("onceflow %s: %v\n%s", arg, err, out)
		}
		for _, w := range want {
			if version == "" || !strings.Contains(string(out), w) {
				t.Errorf("onceflow %s printed %q, want it to contain %q\ngo version -m:\n%s", arg, out, w, meta)
			}
		}
	}
}
