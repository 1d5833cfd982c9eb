// Package exampletest runs the example programs as real processes in
// acceptance tests: built once per test binary, started with exec, stopped
// with SIGTERM (or killed), their output kept for the test log.
package exampletest

import (
	"bytes"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Build compiles the package in the current directory (with -race when the
// tests run with it) into a temporary directory and returns the binary's path
// and a function removing it. Call it from TestMain.
func Build(name string) (bin string, cleanup func(), err error) {
	dir, err := os.MkdirTemp("", "onceflow-example-")
	if err != nil {
		return "", nil, err
	}
	cleanup = func() { os.RemoveAll(dir) }
	bin = filepath.Join(dir, name)
	args := []string{"build", "-o", bin}
	if raceEnabled {
		args = append(args, "-race")
	}
	out, err := exec.Command("go", append(args, ".")...).CombinedOutput()
	if err != nil {
		cleanup()
		return "", nil, fmt.Errorf("go build %s: %v\n%s", name, err, out)
	}
	return bin, cleanup, nil
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
	cmd  *exec.Cmd
	out  *buffer
	done chan struct{}
	err  error // set before done is closed
}

// Start runs bin with args. The process is killed when the test ends if it is
// still running, and its output is logged if the test failed.
func Start(t testing.TB, bin string, args ...string) *Proc {
	t.Helper()
	p := &Proc{name: filepath.Base(bin), cmd: exec.Command(bin, args...), out: &buffer{}, done: make(chan struct{})}
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("exampletest: start %s: %v", bin, err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("output of %s (pid %d):\n%s", p.name, p.cmd.Process.Pid, p.out.String())
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
		if m := re.FindStringSubmatch(p.out.String()); m != nil {
			return m
		}
		select {
		case <-p.done:
			t.Fatalf("%s exited (%v) before printing %q:\n%s", p.name, p.err, re, p.out.String())
		case <-time.After(20 * time.Millisecond):
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
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("exampletest: SIGTERM %s: %v", p.name, err)
	}
	select {
	case <-p.done:
	case <-time.After(timeout):
		t.Fatalf("%s did not exit within %v of SIGTERM", p.name, timeout)
	}
	if p.err != nil {
		t.Fatalf("%s exited with %v after SIGTERM, want exit code 0", p.name, p.err)
	}
}

// Output returns what the process printed so far.
func (p *Proc) Output() string { return p.out.String() }

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

type buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
