// Package exampletest runs the example programs as real processes in
// acceptance tests: built once per test binary, started with exec, stopped
// with SIGTERM (or killed), their output kept for the test log.
package exampletest

import (
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/proctest"
)

// Build compiles the package in the current directory (with -race when the
// tests run with it) into a temporary directory and returns the binary's path
// and a function removing it. Call it from TestMain.
func Build(name string) (bin string, cleanup func(), err error) {
	dir, err := proctest.Build(raceEnabled, ".")
	if err != nil {
		return "", nil, err
	}
	// The binary is named after the package directory; name it as asked.
	bin = filepath.Join(dir, name)
	if built := filepath.Join(dir, filepath.Base(mustGetwd())); built != bin {
		if err := os.Rename(built, bin); err != nil {
			os.RemoveAll(dir)
			return "", nil, err
		}
	}
	return bin, func() { os.RemoveAll(dir) }, nil
}

func mustGetwd() string {
	wd, err := os.Getwd()
	if err != nil {
		panic(err)
	}
	return wd
}

// WithSearchPath returns dbURL with search_path set as a runtime parameter, so
// tables the program creates unqualified land in schema.
func WithSearchPath(t testing.TB, dbURL, schema string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatalf("exampletest: parse database URL: %v", err)
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String()
}

// Proc is a running example program.
type Proc struct {
	name string
	*proctest.Proc
}

// Start runs bin with args. The process is killed when the test ends if it is
// still running, and its output is logged if the test failed.
func Start(t testing.TB, bin string, args ...string) *Proc {
	t.Helper()
	started, err := proctest.Start(bin, nil, args...)
	if err != nil {
		t.Fatalf("exampletest: %v", err)
	}
	p := &Proc{name: filepath.Base(bin), Proc: started}
	t.Cleanup(func() {
		p.Kill()
		if t.Failed() {
			t.Logf("output of %s (pid %d):\n%s", p.name, p.Pid(), p.Output())
		}
	})
	return p
}

// WaitOutput waits until the output matches re and returns the submatches.
// It fails the test if the process exits or the timeout passes first.
func (p *Proc) WaitOutput(t testing.TB, re *regexp.Regexp, timeout time.Duration) []string {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if m := re.FindStringSubmatch(p.Output()); m != nil {
			return m
		}
		if err, exited := p.Wait(20 * time.Millisecond); exited {
			t.Fatalf("%s exited (%v) before printing %q:\n%s", p.name, err, re, p.Output())
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not print %q within %v", p.name, re, timeout)
		}
	}
}

// Stop sends SIGTERM and requires the process to exit with code 0 within
// timeout.
func (p *Proc) Stop(t testing.TB, timeout time.Duration) {
	t.Helper()
	if err := p.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("exampletest: SIGTERM %s: %v", p.name, err)
	}
	err, exited := p.Wait(timeout)
	switch {
	case !exited:
		t.Fatalf("%s did not exit within %v of SIGTERM", p.name, timeout)
	case err != nil:
		t.Fatalf("%s exited with %v after SIGTERM, want exit code 0", p.name, err)
	}
}

// Eventually polls cond every 50ms until it returns nil or timeout passes,
// then fails the test with cond's last error.
func Eventually(t testing.TB, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %v: %v", timeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
