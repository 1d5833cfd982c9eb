package e2e_test

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// binaries are cmd/onceflow and examples/ledger, built once per test binary
// without -race: they are the system under test, not the test, and the race
// detector would cost this 2-core machine more than the test's time budget.
type binaries struct {
	onceflow, ledger string
}

var (
	buildOnce sync.Once
	built     binaries
	buildErr  error
)

func buildBinaries(t *testing.T) binaries {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "onceflow-e2e-")
		if err != nil {
			buildErr = err
			return
		}
		// One go command builds both packages in parallel; -o dir/ names
		// each binary after its package directory.
		cmd := exec.Command("go", "build", "-o", dir+string(filepath.Separator),
			"github.com/onceflow/onceflow/cmd/onceflow",
			"github.com/onceflow/onceflow/examples/ledger")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
			return
		}
		built = binaries{onceflow: filepath.Join(dir, "onceflow"), ledger: filepath.Join(dir, "ledger")}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return built
}

// role is one long-lived part of the system (relay 1, ledger 2, ...): a
// command line that is started, SIGKILLed and started again. Every
// incarnation's output is kept for the failure log.
type role struct {
	name  string
	bin   string
	args  []string
	env   []string
	ready string // output line that says the process is up and past its start-up checks

	cur  *proc
	past []*proc
}

type proc struct {
	cmd    *exec.Cmd
	out    *syncBuffer
	done   chan struct{}
	err    error // exit status, set before done is closed
	killed bool  // by the test
}

func (r *role) start(t *testing.T) {
	t.Helper()
	cmd := exec.Command(r.bin, r.args...)
	cmd.Env = append(os.Environ(), r.env...)
	p := &proc{cmd: cmd, out: &syncBuffer{}, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = p.out, p.out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", r.name, err)
	}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	if r.cur != nil {
		r.past = append(r.past, r.cur)
	}
	r.cur = p
}

// kill SIGKILLs the current process and waits until it is gone.
func (r *role) kill() {
	p := r.cur
	if p == nil {
		return
	}
	p.killed = true
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// exitedOnItsOwn reports whether the current process ended without the test
// killing it, with its exit status.
func (r *role) exitedOnItsOwn() (error, bool) {
	select {
	case <-r.cur.done:
		return r.cur.err, !r.cur.killed
	default:
		return nil, false
	}
}

func (r *role) isReady() bool {
	return strings.Contains(r.cur.out.String(), r.ready)
}

// stop sends SIGTERM once the process is ready (a signal that arrives before
// main installs its handler would kill it by default) and requires exit code
// 0 within timeout.
func (r *role) stop(t *testing.T, timeout time.Duration) {
	t.Helper()
	waitFor(t, r.name+" to be ready", 30*time.Second, func() error {
		if err, ok := r.exitedOnItsOwn(); ok {
			t.Fatalf("%s exited on its own (%v)", r.name, err)
		}
		if !r.isReady() {
			return fmt.Errorf("no %q in its output yet", r.ready)
		}
		return nil
	})
	r.cur.killed = true // by the test, though gracefully
	if err := r.cur.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("SIGTERM %s: %v", r.name, err)
	}
	select {
	case <-r.cur.done:
	case <-time.After(timeout):
		t.Fatalf("%s did not exit within %v of SIGTERM", r.name, timeout)
	}
	if r.cur.err != nil {
		t.Errorf("%s exited with %v after SIGTERM, want exit code 0", r.name, r.cur.err)
	}
}

// dumpStacks sends SIGQUIT, which makes a Go program print every
// goroutine's stack and exit, and waits for it to exit.
func (r *role) dumpStacks() {
	select {
	case <-r.cur.done:
		return
	default:
	}
	r.cur.killed = true
	_ = r.cur.cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-r.cur.done:
	case <-time.After(10 * time.Second):
		r.kill()
	}
}

// cleanup kills what still runs and, if the test failed, logs the tail of
// every incarnation's output.
func (r *role) cleanup(t *testing.T) {
	if r.cur == nil {
		return
	}
	select {
	case <-r.cur.done:
	default:
		r.kill()
	}
	if !t.Failed() {
		return
	}
	for i, p := range append(r.past, r.cur) {
		out := tail(p.out.String(), 60000)
		t.Logf("output of %s, incarnation %d (pid %d, exit %v, killed by test %v):\n%s",
			r.name, i+1, p.cmd.Process.Pid, p.err, p.killed, out)
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// waitFor polls cond every 50ms until it returns nil, failing the test with
// cond's last error after timeout, once diag has run.
func waitFor(t *testing.T, what string, timeout time.Duration, cond func() error, diag ...func()) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			for _, d := range diag {
				d()
			}
			t.Fatalf("timed out after %v waiting for %s: %v", timeout, what, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
