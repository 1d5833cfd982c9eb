package idempotency_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
)

// A request the middleware cannot serve for the database's sake answers
// 503 since context errors map to it, and the default error handler sent
// a 503's error text whole: the pool's connect timeout named the database
// user, database and address to every client (helper 83). A 5xx says
// nothing of the cause; the log has it.
func TestADatabaseOutOfReachIsNotDescribedToClients(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0") // accepts, never answers: a database that hangs
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	pool, err := pgxpool.New(context.Background(), "postgres://secretuser@"+ln.Addr().String()+"/proddb?connect_timeout=1&sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	for _, mode := range []idempotency.Mode{idempotency.Transactional, idempotency.Leased} {
		mw, err := idempotency.New(pool, &idempotency.Config{Mode: mode, Scope: idempotency.SharedScope})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) })))
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/x", strings.NewReader("{}"))
		req.Header.Set(idempotency.KeyHeader, "k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		srv.Close()
		t.Logf("%v: %d %q", mode, resp.StatusCode, body)
		if strings.Contains(string(body), "secretuser") || strings.Contains(string(body), "127.0.0.1") || strings.Contains(string(body), "proddb") {
			t.Errorf("%v: the client was sent the database's connection details: %d %q", mode, resp.StatusCode, body)
		}
	}
}
