// Package proctest runs programs under test as real processes: built once,
// started with exec, signalled or SIGKILLed, their output kept. Crash tests
// use it to kill relays and consumers at random moments.
package proctest

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Build compiles the given packages (import paths or directories) with one
// go command into a new temporary directory and returns it; each binary is
// named after its package directory. race adds -race.
func Build(race bool, pkgs ...string) (dir string, err error) {
	dir, err = os.MkdirTemp("", "onceflow-bin-")
	if err != nil {
		return "", err
	}
	args := []string{"build", "-o", dir + string(filepath.Separator)}
	if race {
		args = append(args, "-race")
	}
	if out, err := exec.Command("go", append(args, pkgs...)...).CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return "", fmt.Errorf("go build %s: %v\n%s", strings.Join(pkgs, " "), err, out)
	}
	return dir, nil
}

// Proc is a started process. Its methods are safe for concurrent use.
type Proc struct {
	cmd  *exec.Cmd
	out  *Buffer
	done chan struct{}
	err  error // exit status, set before done is closed
}

// Start runs bin with args and the environment plus env; stdout and stderr
// go to one buffer.
func Start(bin string, env []string, args ...string) (*Proc, error) {
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	p := &Proc{cmd: cmd, out: &Buffer{}, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = p.out, p.out
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	return p, nil
}

// Pid returns the process id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Signal sends sig; it does nothing once the process has exited.
func (p *Proc) Signal(sig os.Signal) error {
	if _, exited := p.Exited(); exited {
		return nil
	}
	return p.cmd.Process.Signal(sig)
}

// Kill SIGKILLs the process and waits until it is gone. Killing an exited
// process is a no-op.
func (p *Proc) Kill() {
	_ = p.Signal(syscall.SIGKILL)
	<-p.done
}

// Wait returns the exit status, or exited false if the process still runs
// after timeout.
func (p *Proc) Wait(timeout time.Duration) (err error, exited bool) {
	select {
	case <-p.done:
		return p.err, true
	case <-time.After(timeout):
		return nil, false
	}
}

// Exited reports, without waiting, whether the process has exited and how.
func (p *Proc) Exited() (err error, exited bool) {
	select {
	case <-p.done:
		return p.err, true
	default:
		return nil, false
	}
}

// Done is closed when the process has exited.
func (p *Proc) Done() <-chan struct{} { return p.done }

// Output returns what the process printed so far.
func (p *Proc) Output() string { return p.out.String() }

// Printed reports whether the output so far contains s.
func (p *Proc) Printed(s string) bool { return strings.Contains(p.out.String(), s) }

// Buffer is a bytes.Buffer safe for concurrent writers and readers.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
