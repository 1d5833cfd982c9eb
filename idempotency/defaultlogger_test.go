package idempotency_test

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/internal/proctest"
)

// With a nil Logger, the middleware's failures (here a
// role without the grants README lists: every request answered 500) go to
// slog.Default(), as the janitor's and the purger's do: they were
// discarded, and an operator saw 500s with no cause anywhere.
func TestFailuresAreLoggedToTheDefaultLoggerWithoutALogger(t *testing.T) {
	logs := &proctest.Buffer{}
	old := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(logs, nil)))
	t.Cleanup(func() { slog.SetDefault(old) })

	schema := pgtest.Schema(t)
	noGrants := pgtest.RolePool(t, schema, `GRANT USAGE ON SCHEMA {s} TO {role}`)
	m, err := idempotency.New(noGrants, &idempotency.Config{Schema: schema, Mode: idempotency.Leased, Scope: idempotency.SharedScope})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})))
	t.Cleanup(srv.Close)
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader("{}"))
	req.Header.Set("Idempotency-Key", "k-1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusInternalServerError {
		t.Fatalf("status %d, want 500 for a role without grants", resp.StatusCode)
	}
	if out := logs.String(); !strings.Contains(out, "idempotency: request failed") || !strings.Contains(out, "42501") {
		t.Fatalf("the middleware's failure reached slog.Default() as %q", out)
	}

}
