package idempotency_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// The crash tests re-run the test binary as a tiny server (runChild), let a
// request reach the handler, and kill the process with SIGKILL.
const childEnv = "IDEMPOTENCY_TEST_CHILD"

// runChild serves the middleware in the mode named by the environment. Its
// handler writes an effect, says "in-handler" on stdout and hangs.
func runChild() {
	fail := func(err error) { fmt.Println("error:", err); os.Exit(2) }
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(os.Getenv("IDEMPOTENCY_TEST_URL"))
	if err != nil {
		fail(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = os.Getenv("IDEMPOTENCY_TEST_APP")
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fail(err)
	}
	schema := os.Getenv("IDEMPOTENCY_TEST_SCHEMA")
	mode := idempotency.Transactional
	if os.Getenv(childEnv) == "leased" {
		mode = idempotency.Leased
	}
	m, err := idempotency.New(pool, &idempotency.Config{Schema: schema, Mode: mode, Lease: 2 * time.Second, Scope: userScope})
	if err != nil {
		fail(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fail(err)
	}
	fmt.Println("addr", ln.Addr().String())
	_ = http.Serve(ln, m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := writeEffect(r.Context(), pool, schema, "child"); err != nil {
			fail(err)
		}
		fmt.Println("in-handler")
		select {} // killed here
	})))
}

// startAndKill runs a child in mode, sends it a request with key and kills
// it with SIGKILL once the handler has written its effect.
func startAndKill(t *testing.T, b bundle, mode, key string) (app string) {
	t.Helper()
	app = "idemchild_" + b.schema
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+mode, "IDEMPOTENCY_TEST_URL="+pgtest.URL(t),
		"IDEMPOTENCY_TEST_SCHEMA="+b.schema, "IDEMPOTENCY_TEST_APP="+app)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	lines := make(chan string, 4)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	next := func() string {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatal("child exited early")
			}
			return l
		case <-time.After(30 * time.Second):
			t.Fatal("child said nothing for 30s")
		}
		return ""
	}
	addr, ok := strings.CutPrefix(next(), "addr ")
	if !ok {
		t.Fatalf("child did not start")
	}
	reqErr := make(chan error, 1)
	go func() {
		_, err := trySend("http://"+addr, request{key: key, body: "{}"})
		reqErr <- err
	}()
	if l := next(); l != "in-handler" {
		t.Fatalf("child said %q, want in-handler", l)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	if err := <-reqErr; err == nil {
		t.Fatal("request to the killed child succeeded")
	}
	return app
}

func TestTransactionalKilledMidRequestLeavesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	app := startAndKill(t, b, "transactional", "k-crash")
	// PostgreSQL rolls back when it notices the client is gone; wait for
	// that so the checks below see the settled state, not an open
	// transaction.
	waitFor(t, 20*time.Second, "the killed child's sessions to end", func() bool {
		var n int
		_ = b.pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&n)
		return n == 0
	})
	if r, e := b.records(t), b.effects(t); r != 0 || e != 0 {
		t.Fatalf("after the crash: %d claims, %d business rows; want none", r, e)
	}
	var runs int
	srv := newServer(t, b, idempotency.Config{}, func(w http.ResponseWriter, r *http.Request) {
		runs++
		_ = writeEffect(r.Context(), b.pool, b.schema, "retry")
		w.WriteHeader(http.StatusCreated)
	})
	if r := send(t, srv, request{key: "k-crash", body: "{}"}); r.status != http.StatusCreated || r.replayed {
		t.Fatalf("retry after the crash: %d replayed=%v, want a fresh 201", r.status, r.replayed)
	}
	if runs != 1 || b.effects(t) != 1 {
		t.Fatalf("retry: %d runs, %d effects; want 1 and 1", runs, b.effects(t))
	}
}

func TestLeasedKilledMidRequestIsReclaimableAfterTheLease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	startAndKill(t, b, "leased", "k-crash")
	table := pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()
	var state string
	var leaseUntil time.Time
	if err := b.pool.QueryRow(context.Background(), `SELECT state, lease_until FROM `+table+` WHERE key = 'k-crash'`).Scan(&state, &leaseUntil); err != nil {
		t.Fatalf("the killed request's claim: %v", err)
	}
	if state != "running" {
		t.Fatalf("claim state %q, want running", state)
	}
	srv := newServer(t, b, idempotency.Config{Mode: idempotency.Leased}, func(w http.ResponseWriter, r *http.Request) {
		_ = writeEffect(r.Context(), b.pool, b.schema, "retry")
		w.WriteHeader(http.StatusCreated)
	})
	var leaseHolds bool
	if err := b.pool.QueryRow(context.Background(), `SELECT now() < $1`, leaseUntil).Scan(&leaseHolds); err != nil {
		t.Fatal(err)
	}
	if !leaseHolds {
		t.Fatal("the 2s lease was over before the test could check it")
	}
	if r := send(t, srv, request{key: "k-crash", body: "{}"}); r.status != http.StatusConflict {
		t.Fatalf("retry while the dead claim's lease holds: %d, want 409", r.status)
	}
	var last response
	waitFor(t, 20*time.Second, "the key to become claimable", func() bool {
		last = send(t, srv, request{key: "k-crash", body: "{}"})
		return last.status != http.StatusConflict
	})
	if last.status != http.StatusCreated || last.replayed {
		t.Fatalf("retry after the lease: %d replayed=%v, want a fresh 201", last.status, last.replayed)
	}
	var takenAt time.Time
	if err := b.pool.QueryRow(context.Background(), `SELECT created_at FROM `+table+` WHERE key = 'k-crash'`).Scan(&takenAt); err != nil {
		t.Fatal(err)
	}
	if takenAt.Before(leaseUntil) {
		t.Fatalf("key taken over at %s, before the dead claim's lease ended at %s", takenAt, leaseUntil)
	}
	// The effect outside the transaction happened twice, under the same key:
	// that is what the key passed downstream is for.
	var n, keys int
	if err := b.pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT key) FROM `+pgx.Identifier{b.schema, "effects"}.Sanitize()).Scan(&n, &keys); err != nil {
		t.Fatal(err)
	}
	if n != 2 || keys != 1 {
		t.Fatalf("effects: %d rows under %d keys, want 2 under 1", n, keys)
	}
}
