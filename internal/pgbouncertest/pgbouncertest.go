// Package pgbouncertest gives tests Debian's PgBouncer in front of the test
// database, in session and in transaction mode (scripts/pgbouncer.sh), and
// holds the tests of onceflow's parts behind it.
package pgbouncertest

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
)

// Env is a running PgBouncer.
type Env struct {
	SessionURL, TransactionURL string
	Password                   string
	CAFile                     string
	Addr                       string
}

var (
	once   sync.Once
	env    Env
	envErr error
)

// Start returns the PgBouncer named by ONCEFLOW_TEST_PGBOUNCER_* or, when
// they are unset, starts scripts/pgbouncer.sh (idempotent; it installs
// Debian's pgbouncer if missing). A PgBouncer that cannot start fails the
// test with the script's reason.
func Start(t testing.TB) Env {
	t.Helper()
	once.Do(func() {
		if u := os.Getenv("ONCEFLOW_TEST_PGBOUNCER_SESSION_URL"); u != "" {
			env = Env{SessionURL: u, TransactionURL: os.Getenv("ONCEFLOW_TEST_PGBOUNCER_TRANSACTION_URL"),
				Password: os.Getenv("ONCEFLOW_TEST_PGBOUNCER_PASSWORD"), CAFile: os.Getenv("ONCEFLOW_TEST_PGBOUNCER_CA_FILE"),
				Addr: os.Getenv("ONCEFLOW_TEST_PGBOUNCER_ADDR")}
			return
		}
		env, envErr = runScript()
	})
	if envErr != nil {
		t.Fatalf("pgbouncertest: %v", envErr)
	}
	if env.SessionURL == "" || env.TransactionURL == "" {
		t.Fatal("pgbouncertest: scripts/pgbouncer.sh printed no URLs")
	}
	return env
}

// StartPrivate starts a PgBouncer of the test's own (scripts/pgbouncer.sh
// with a state directory of its own), for a test that changes what its
// server connections hold, and stops it when the test ends.
func StartPrivate(t testing.TB) Env {
	t.Helper()
	// Not t.TempDir: PgBouncer runs as nobody, and a test's temporary
	// directory sits in one only its owner may enter.
	dir, err := os.MkdirTemp("", "onceflow-pgbouncer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = exec.Command("bash", script(), "--state", dir, "stop").Run()
		_ = os.RemoveAll(dir)
	})
	e, err := runScript("--state", dir)
	if err != nil {
		t.Fatalf("pgbouncertest: %v", err)
	}
	return e
}

func script() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "scripts", "pgbouncer.sh")
}

// runScript runs scripts/pgbouncer.sh start with args before the verb and
// reads the environment it prints.
func runScript(args ...string) (Env, error) {
	var stderr bytes.Buffer
	cmd := exec.Command("bash", append(append([]string{script()}, args...), "start")...)
	if len(args) > 0 {
		// A private state directory: not the shared one's variable.
		cmd.Env = append(os.Environ(), "ONCEFLOW_PGBOUNCER_STATE=")
	}
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return Env{}, &startError{err: err, stderr: stderr.String()}
	}
	vars := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := strings.TrimPrefix(sc.Text(), "export ")
		if k, v, ok := strings.Cut(line, "="); ok {
			vars[k] = strings.Trim(v, "'")
		}
	}
	return Env{SessionURL: vars["ONCEFLOW_TEST_PGBOUNCER_SESSION_URL"], TransactionURL: vars["ONCEFLOW_TEST_PGBOUNCER_TRANSACTION_URL"],
		Password: vars["ONCEFLOW_TEST_PGBOUNCER_PASSWORD"], CAFile: vars["ONCEFLOW_TEST_PGBOUNCER_CA_FILE"], Addr: vars["ONCEFLOW_TEST_PGBOUNCER_ADDR"]}, nil
}

type startError struct {
	err    error
	stderr string
}

func (e *startError) Error() string {
	return "scripts/pgbouncer.sh start: " + e.err.Error() + ": " + strings.TrimSpace(e.stderr)
}
