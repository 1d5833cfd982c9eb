package e2e_test

import (
	"fmt"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/proctest"
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
		// One go command builds both packages; each binary is named after
		// its package directory.
		var dir string
		dir, buildErr = proctest.Build(false,
			"github.com/onceflow/onceflow/cmd/onceflow",
			"github.com/onceflow/onceflow/examples/ledger")
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
	*proctest.Proc
	killed bool // by the test
}

func (r *role) start(t *testing.T) {
	t.Helper()
	started, err := proctest.Start(r.bin, r.env, r.args...)
	if err != nil {
		t.Fatalf("start %s: %v", r.name, err)
	}
	p := &proc{Proc: started}
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
	p.Kill()
}

// exitedOnItsOwn reports whether the current process ended without the test
// killing it, with its exit status.
func (r *role) exitedOnItsOwn() (error, bool) {
	err, exited := r.cur.Exited()
	return err, exited && !r.cur.killed
}

func (r *role) isReady() bool {
	return r.cur.Printed(r.ready)
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
	if err := r.cur.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("SIGTERM %s: %v", r.name, err)
	}
	err, exited := r.cur.Wait(timeout)
	switch {
	case !exited:
		t.Fatalf("%s did not exit within %v of SIGTERM", r.name, timeout)
	case err != nil:
		t.Errorf("%s exited with %v after SIGTERM, want exit code 0", r.name, err)
	}
}

// dumpStacks sends SIGQUIT, which makes a Go program print every
// goroutine's stack and exit, and waits for it to exit.
func (r *role) dumpStacks() {
	if _, exited := r.cur.Exited(); exited {
		return
	}
	r.cur.killed = true
	_ = r.cur.Signal(syscall.SIGQUIT)
	if _, exited := r.cur.Wait(10 * time.Second); !exited {
		r.kill()
	}
}

// cleanup kills what still runs and, if the test failed, logs the tail of
// every incarnation's output.
func (r *role) cleanup(t *testing.T) {
	if r.cur == nil {
		return
	}
	if _, exited := r.cur.Exited(); !exited {
		r.kill()
	}
	if !t.Failed() {
		return
	}
	for i, p := range append(r.past, r.cur) {
		out := tail(p.Output(), 60000)
		exit, _ := p.Exited()
		t.Logf("output of %s, incarnation %d (pid %d, exit %v, killed by test %v):\n%s",
			r.name, i+1, p.Pid(), exit, p.killed, out)
	}
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
