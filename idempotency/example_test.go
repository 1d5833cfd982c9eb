package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// exampleDB connects and migrates a throwaway schema ("onceflow" in
// production).
func exampleDB(ctx context.Context) (pool *pgxpool.Pool, schema string, cleanup func()) {
	url := os.Getenv("ONCEFLOW_TEST_DATABASE_URL")
	if url == "" {
		url = pgtest.DefaultURL
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		panic(err)
	}
	schema = pgtest.NewSchemaName()
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		panic(err)
	}
	return pool, schema, func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		pool.Close()
	}
}

// An order endpoint: the order row and the stored response commit together.
func ExampleMiddleware_Handler() {
	ctx := context.Background()
	pool, schema, cleanup := exampleDB(ctx)
	defer cleanup()
	orders := pgx.Identifier{schema, "orders"}.Sanitize()
	_, _ = pool.Exec(ctx, `CREATE TABLE `+orders+` (id bigint GENERATED ALWAYS AS IDENTITY, customer text)`)

	mw, err := idempotency.New(pool, &idempotency.Config{
		Schema: schema,
		Scope: func(r *http.Request) (string, error) { // required: keys are per signed-in user
			if u := r.Header.Get("X-User"); u != "" {
				return u, nil
			}
			return "", errors.New("not signed in")
		},
	})
	if err != nil {
		panic(err)
	}
	srv := httptest.NewServer(mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var id int64
		err := idempotency.Tx(r.Context()).QueryRow(r.Context(),
			`INSERT INTO `+orders+` (customer) VALUES ('c1') RETURNING id`).Scan(&id)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order_id":%d}`, id)
	})))
	defer srv.Close()

	post := func(body string) {
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(body))
		req.Header.Set("Idempotency-Key", "3f1c9a")
		req.Header.Set("X-User", "alice")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		fmt.Println(resp.StatusCode, strings.TrimSpace(string(b)), "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	post(`{"customer":"c1"}`)
	post(`{"customer":"c1"}`) // a retry
	post(`{"customer":"c2"}`) // the key reused for another request

	var n int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM `+orders).Scan(&n)
	fmt.Println("orders:", n)
	// Output:
	// 201 {"order_id":1} replayed: false
	// 201 {"order_id":1} replayed: true
	// 422 idempotency: key already used for a different request replayed: false
	// orders: 1
}

// A payment charged at most once per order, however often the message
// asking for it is delivered.
func ExampleFence_Do() {
	ctx := context.Background()
	pool, schema, cleanup := exampleDB(ctx)
	defer cleanup()
	fence, err := idempotency.NewFence(pool, &idempotency.FenceConfig{Schema: schema, Namespace: "payments"})
	if err != nil {
		panic(err)
	}
	charges := 0
	charge := func(ctx context.Context) ([]byte, error) {
		charges++ // a real gateway call would pass idempotency.Key(ctx) along
		return []byte("receipt for " + idempotency.ClientKey(ctx)), nil
	}
	for range 3 { // the same message, delivered three times
		receipt, err := fence.Do(ctx, "order-42", charge)
		fmt.Println(string(receipt), err)
	}
	fmt.Println("charges:", charges)
	// Output:
	// receipt for order-42 <nil>
	// receipt for order-42 <nil>
	// receipt for order-42 <nil>
	// charges: 1
}
