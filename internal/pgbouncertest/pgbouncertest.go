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
		_, file, _, _ := runtime.Caller(0)
		script := filepath.Join(filepath.Dir(file), "..", "..", "scripts", "pgbouncer.sh")
		var stderr bytes.Buffer
		cmd := exec.Command("bash", script, "start")
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			envErr = &startError{err: err, stderr: stderr.String()}
			return
		}
		vars := map[string]string{}
		sc := bufio.NewScanner(bytes.NewReader(out))
		for sc.Scan() {
			line := strings.TrimPrefix(sc.Text(), "export ")
			if k, v, ok := strings.Cut(line, "="); ok {
				vars[k] = strings.Trim(v, "'")
			}
		}
		env = Env{SessionURL: vars["ONCEFLOW_TEST_PGBOUNCER_SESSION_URL"], TransactionURL: vars["ONCEFLOW_TEST_PGBOUNCER_TRANSACTION_URL"],
			Password: vars["ONCEFLOW_TEST_PGBOUNCER_PASSWORD"], CAFile: vars["ONCEFLOW_TEST_PGBOUNCER_CA_FILE"], Addr: vars["ONCEFLOW_TEST_PGBOUNCER_ADDR"]}
	})
	if envErr != nil {
		t.Fatalf("pgbouncertest: %v", envErr)
	}
	if env.SessionURL == "" || env.TransactionURL == "" {
		t.Fatal("pgbouncertest: scripts/pgbouncer.sh printed no URLs")
	}
	return env
}

type startError struct {
	err    error
	stderr string
}

func (e *startError) Error() string {
	return "scripts/pgbouncer.sh start: " + e.err.Error() + ": " + strings.TrimSpace(e.stderr)
}
