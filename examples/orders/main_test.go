package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/examples/internal/exampletest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

var bin string

func TestMain(m *testing.M) {
	b, cleanup, err := exampletest.Build("orders")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin = b
	code := m.Run()
	cleanup()
	os.Exit(code)
}

var listening = regexp.MustCompile(`orders: listening" addr=(\S+)`)

// service is one running orders process on its own schema.
type service struct {
	proc   *exampletest.Proc
	base   string // http://host:port
	schema string
}

func start(t *testing.T) *service {
	t.Helper()
	schema := pgtest.Schema(t) // onceflow's tables and, via search_path, orders
	url := exampletest.WithSearchPath(t, pgtest.URL(t), schema)
	p := exampletest.Start(t, bin, "--database-url", url, "--schema", schema, "--addr", "127.0.0.1:0")
	addr := p.WaitOutput(t, listening, 30*time.Second)[1]
	return &service{proc: p, base: "http://" + addr, schema: schema}
}

type response struct {
	status   int
	replayed bool
	body     string
}

func (s *service) post(t *testing.T, user, key, body string) response {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, s.base+"/orders", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if user != "" {
		req.Header.Set("X-User", user)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Errorf("POST /orders: %v", err)
		return response{}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Errorf("POST /orders: read body: %v", err)
	}
	return response{status: resp.StatusCode, replayed: resp.Header.Get("Idempotent-Replayed") == "true", body: string(b)}
}

// counts returns the number of orders and of outbox events on topic orders.
func (s *service) counts(t *testing.T) (orders, events int) {
	t.Helper()
	err := pgtest.Pool(t).QueryRow(context.Background(), `SELECT
		(SELECT count(*) FROM `+pgx.Identifier{s.schema, "orders"}.Sanitize()+`),
		(SELECT count(*) FROM `+pgx.Identifier{s.schema, "outbox"}.Sanitize()+` WHERE topic = 'orders')`).Scan(&orders, &events)
	if err != nil {
		t.Fatalf("count rows: %v", err)
	}
	return orders, events
}

func (s *service) wantCounts(t *testing.T, orders, events int) {
	t.Helper()
	if o, e := s.counts(t); o != orders || e != events {
		t.Fatalf("rows: %d orders, %d outbox events; want %d and %d", o, e, orders, events)
	}
}

func orderID(t *testing.T, r response) string {
	t.Helper()
	var o struct {
		OrderID string `json:"order_id"`
	}
	if err := json.Unmarshal([]byte(r.body), &o); err != nil || o.OrderID == "" {
		t.Fatalf("201 body %q holds no order_id (%v)", r.body, err)
	}
	return o.OrderID
}

func want(t *testing.T, what string, got response, status int, replayed bool) {
	t.Helper()
	if got.status != status || got.replayed != replayed {
		t.Fatalf("%s: got %d (replayed %v) %q, want %d (replayed %v)", what, got.status, got.replayed, got.body, status, replayed)
	}
}

const order1 = `{"customer":"c1","amount_cents":500}`

// The answers a client sees, and the rows behind them.
func TestOrdersStatusCodes(t *testing.T) {
	t.Parallel()
	s := start(t)

	want(t, "no X-User", s.post(t, "", "k1", order1), http.StatusUnauthorized, false)
	want(t, "no Idempotency-Key", s.post(t, "u1", "", order1), http.StatusBadRequest, false)
	s.wantCounts(t, 0, 0)

	first := s.post(t, "u1", "k1", order1)
	want(t, "first request", first, http.StatusCreated, false)
	id := orderID(t, first)
	s.wantCounts(t, 1, 1)
	var value []byte
	if err := pgtest.Pool(t).QueryRow(context.Background(),
		`SELECT value FROM `+pgx.Identifier{s.schema, "outbox"}.Sanitize()+` WHERE key = $1`, []byte(id)).Scan(&value); err != nil {
		t.Fatalf("outbox event for order %s: %v", id, err)
	}
	if !strings.Contains(string(value), id) {
		t.Fatalf("outbox event %s does not name order %s", value, id)
	}

	retry := s.post(t, "u1", "k1", order1)
	want(t, "retry", retry, http.StatusCreated, true)
	if retry.body != first.body {
		t.Fatalf("replayed body %q, want %q", retry.body, first.body)
	}
	want(t, "same key, other body", s.post(t, "u1", "k1", `{"customer":"c1","amount_cents":501}`), http.StatusUnprocessableEntity, false)
	s.wantCounts(t, 1, 1)

	other := s.post(t, "u2", "k1", order1) // keys are per user
	want(t, "same key, other user", other, http.StatusCreated, false)
	if orderID(t, other) == id {
		t.Fatalf("user u2 got user u1's order %s", id)
	}
	s.wantCounts(t, 2, 2)

	want(t, "malformed JSON", s.post(t, "u1", "k2", `{"customer":`), http.StatusBadRequest, false)
	want(t, "malformed JSON retried", s.post(t, "u1", "k2", `{"customer":`), http.StatusBadRequest, true)
	s.wantCounts(t, 2, 2)
	// Two objects in one body are malformed too: the decoder read the
	// first, and the order was created from it (helper 79).
	want(t, "trailing data", s.post(t, "u1", "k3", order1+`{"customer":"c2","amount_cents":1}`), http.StatusBadRequest, false)
	s.wantCounts(t, 2, 2)

	s.proc.Stop(t, 20*time.Second)
}

// A retry while the first request still runs gets 409; the first then
// completes and later retries replay it.
func TestOrdersRetryWhileRunning(t *testing.T) {
	t.Parallel()
	s := start(t)
	ctx := context.Background()
	pool := pgtest.Pool(t)
	orders := pgx.Identifier{s.schema, "orders"}.Sanitize()

	// Hold the first request inside its transaction: its INSERT waits for
	// this lock.
	lock, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Rollback(ctx)
	if _, err := lock.Exec(ctx, `LOCK TABLE `+orders+` IN SHARE MODE`); err != nil {
		t.Fatal(err)
	}
	firstDone := make(chan response, 1)
	go func() { firstDone <- s.post(t, "u1", "k1", order1) }()
	exampletest.Eventually(t, 10*time.Second, func() error {
		var waiting bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE relation = $1::regclass AND NOT granted)`, orders).Scan(&waiting); err != nil {
			return err
		}
		if !waiting {
			return fmt.Errorf("first request not waiting on the orders table yet")
		}
		return nil
	})

	want(t, "retry while running", s.post(t, "u1", "k1", order1), http.StatusConflict, false)
	if err := lock.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	first := <-firstDone
	want(t, "first request", first, http.StatusCreated, false)
	want(t, "retry after completion", s.post(t, "u1", "k1", order1), http.StatusCreated, true)
	s.wantCounts(t, 1, 1)

	s.proc.Stop(t, 20*time.Second)
}

// Of many identical requests sent at once, exactly one runs: one order, one
// event, one 201 without the replay header. The rest get 409 or the replay.
func TestOrdersConcurrentIdentical(t *testing.T) {
	t.Parallel()
	s := start(t)

	const n = 25
	var wg sync.WaitGroup
	gate := make(chan struct{})
	results := make([]response, n)
	for i := range results {
		wg.Go(func() {
			<-gate
			results[i] = s.post(t, "u1", "same", order1)
		})
	}
	close(gate)
	wg.Wait()

	ran, ids := 0, map[string]bool{}
	for _, r := range results {
		switch {
		case r.status == http.StatusCreated:
			if !r.replayed {
				ran++
			}
			ids[orderID(t, r)] = true
		case r.status == http.StatusConflict:
		default:
			t.Fatalf("unexpected answer %d %q", r.status, r.body)
		}
	}
	if ran != 1 || len(ids) != 1 {
		t.Fatalf("%d requests ran, %d order ids answered; want 1 and 1: %+v", ran, len(ids), results)
	}
	s.wantCounts(t, 1, 1)

	s.proc.Stop(t, 20*time.Second)
}

// Two services started at the same moment on a database with neither
// onceflow's tables nor orders: both migrate, create the table and serve.
func TestOrdersTwoProcessesStartTogether(t *testing.T) {
	t.Parallel()
	app := pgtest.EmptySchema(t)
	if _, err := pgtest.Pool(t).Exec(context.Background(), `CREATE SCHEMA `+pgx.Identifier{app}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	schema, url := pgtest.EmptySchema(t), exampletest.WithSearchPath(t, pgtest.URL(t), app)
	var procs []*service
	for range 2 {
		p := exampletest.Start(t, bin, "--database-url", url, "--schema", schema, "--addr", "127.0.0.1:0")
		procs = append(procs, &service{proc: p, schema: app})
	}
	for i, s := range procs {
		s.base = "http://" + s.proc.WaitOutput(t, listening, 30*time.Second)[1]
		want(t, "order", s.post(t, "u1", fmt.Sprintf("k%d", i), order1), http.StatusCreated, false)
	}
	var orders int
	if err := pgtest.Pool(t).QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{app, "orders"}.Sanitize()).Scan(&orders); err != nil {
		t.Fatal(err)
	}
	if orders != 2 {
		t.Fatalf("%d orders, want 2", orders)
	}
	for _, s := range procs {
		s.proc.Stop(t, 20*time.Second)
	}
}

// helper 121: the expired-key purger ran on the signal context, and run
// waited for it on every return: an address already in use (or any error
// after the purger started) left a silent process hanging until a signal,
// instead of exiting 1 with the error.
func TestOrdersExitsWhenItCannotListen(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	schema := pgtest.Schema(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "--database-url", exampletest.WithSearchPath(t, pgtest.URL(t), schema),
		"--schema", schema, "--addr", taken.Addr().String())
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("still running 30 s after its address was found taken:\n%s", out)
	}
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(string(out), "address already in use") {
		t.Fatalf("exit %v, want 1 naming the address in use:\n%s", err, out)
	}
}

// helper 121: the example took ONCEFLOW_DATABASE_URL as --database-url's
// default, so --help printed the URL, password and all; and an unparsable
// URL came back in "connect: …" (net/url quotes it whole). The binary
// avoids both; so do the examples now, which users copy.
func TestExampleDoesNotPrintTheDatabasePassword(t *testing.T) {
	for _, args := range [][]string{{"--help"}, {"--database-url", "postgres://u:hunter2@db.invalid:port/x"}} {
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), "ONCEFLOW_DATABASE_URL=postgres://u:hunter2@db.invalid/x", "ONCEFLOW_BROKERS=k:9092")
		out, _ := cmd.CombinedOutput()
		if strings.Contains(string(out), "hunter2") {
			t.Errorf("%v prints the database password:\n%s", args, out)
		}
	}
}
