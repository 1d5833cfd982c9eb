package idempotency_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		runChild()
		return
	}
	code := m.Run()
	if code == 0 {
		if err := checkLeaks(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			code = 1
		}
	}
	os.Exit(code)
}

// checkLeaks fails when a lease-renewal goroutine outlives the tests.
// (goleak is not a dependency of the module yet.)
func checkLeaks() error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		buf := make([]byte, 1<<20)
		stacks := string(buf[:runtime.Stack(buf, true)])
		if !strings.Contains(stacks, "idempotency.(*store).keepLease") {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("leaked lease goroutines:\n%s", stacks)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// bundle is what a test needs besides the server.
type bundle struct {
	pool   *pgxpool.Pool
	schema string
}

// setup returns a fresh schema with an "effects" table for handlers to write
// their business rows to.
func setup(t *testing.T) bundle {
	t.Helper()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(context.Background(), `CREATE TABLE `+pgx.Identifier{schema, "effects"}.Sanitize()+
		` (id bigint GENERATED ALWAYS AS IDENTITY, key text NOT NULL, note text)`); err != nil {
		t.Fatal(err)
	}
	return bundle{pool: pool, schema: schema}
}

func (b bundle) effects(t testing.TB) int {
	t.Helper()
	var n int
	if err := b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{b.schema, "effects"}.Sanitize()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func (b bundle) records(t testing.TB) int {
	t.Helper()
	var n int
	if err := b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// writeEffect writes a business row: through the middleware's transaction
// when there is one, else straight to the pool (an "outside" effect).
func writeEffect(ctx context.Context, pool *pgxpool.Pool, schema, note string) error {
	sql := `INSERT INTO ` + pgx.Identifier{schema, "effects"}.Sanitize() + ` (key, note) VALUES ($1, $2)`
	if tx := idempotency.Tx(ctx); tx != nil {
		_, err := tx.Exec(ctx, sql, idempotency.ClientKey(ctx), note)
		return err
	}
	_, err := pool.Exec(ctx, sql, idempotency.ClientKey(ctx), note)
	return err
}

func newServer(t *testing.T, b bundle, cfg idempotency.Config, h http.HandlerFunc) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(newMiddleware(t, b, cfg).Handler(h))
	t.Cleanup(srv.Close)
	return srv
}

// newMiddleware returns a Middleware on b's schema, scoped by X-User
// unless cfg says otherwise.
func newMiddleware(t *testing.T, b bundle, cfg idempotency.Config) *idempotency.Middleware {
	t.Helper()
	cfg.Schema = b.schema
	if cfg.Scope == nil {
		cfg.Scope = userScope
	}
	m, err := idempotency.New(b.pool, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func userScope(r *http.Request) (string, error) {
	u := r.Header.Get("X-User")
	if u == "" {
		return "", fmt.Errorf("no X-User")
	}
	return u, nil
}

type response struct {
	status   int
	header   http.Header
	body     string
	replayed bool
}

type request struct {
	method, path, key, user, body string
	header                        map[string]string
}

func send(t testing.TB, srv *httptest.Server, req request) response {
	t.Helper()
	resp, err := trySend(srv.URL, req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func trySend(base string, req request) (response, error) {
	if req.method == "" {
		req.method = http.MethodPost
	}
	if req.path == "" {
		req.path = "/orders"
	}
	if req.user == "" {
		req.user = "alice"
	}
	hr, err := http.NewRequest(req.method, base+req.path, strings.NewReader(req.body))
	if err != nil {
		return response{}, err
	}
	if req.key != "" {
		hr.Header.Set(idempotency.KeyHeader, req.key)
	}
	if req.user != "-" {
		hr.Header.Set("X-User", req.user)
	}
	for k, v := range req.header {
		hr.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(hr)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return response{}, err
	}
	return response{status: resp.StatusCode, header: resp.Header, body: string(body),
		replayed: resp.Header.Get(idempotency.ReplayedHeader) == "true"}, nil
}

// waitFor polls cond until it holds or the timeout passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
