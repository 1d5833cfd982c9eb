// Command orders is an HTTP service whose POST is safe to retry. Each order
// row and the event announcing it commit in one transaction with the
// Idempotency-Key record, so a retried request answers what the first one
// answered instead of creating a second order.
//
//	go run ./examples/orders --database-url URL --addr 127.0.0.1:8080
//
//	curl -i -X POST localhost:8080/orders -H 'X-User: u1' -H 'Idempotency-Key: k1' \
//		-d '{"customer":"c1","amount_cents":500}'
//
// X-User stands in for the authenticated principal: keys are scoped per user.
// Orders live in the table orders, in the connection's default schema; their
// events wait in onceflow's outbox for the relay (onceflow relay) to publish
// them to the topic "orders".
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/otelenv"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/otelonceflow"
	"github.com/onceflow/onceflow/outbox"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := run(ctx, os.Args[1:], log); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "orders:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, log *slog.Logger) error {
	fs := flag.NewFlagSet("orders", flag.ContinueOnError)
	// No defaults from the environment: --help prints them, and the URL
	// may hold the password. Read after Parse.
	dbURL := fs.String("database-url", "", "PostgreSQL URL (env ONCEFLOW_DATABASE_URL)")
	schema := fs.String("schema", envOr("ONCEFLOW_SCHEMA", migrations.DefaultSchema), "schema holding onceflow's tables (env ONCEFLOW_SCHEMA)")
	addr := fs.String("addr", "127.0.0.1:8080", "address to listen on")
	tracing := fs.Bool("trace", false, "trace requests with OpenTelemetry: each order's event carries the request's trace context to its consumers; spans are exported as the standard OTEL_* environment variables say (OTEL_EXPORTER_OTLP_ENDPOINT, ...)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dbURL == "" {
		*dbURL = os.Getenv("ONCEFLOW_DATABASE_URL")
	}
	if *dbURL == "" {
		return errors.New("--database-url is required")
	}

	pool, err := pgxpool.New(ctx, *dbURL)
	if err != nil {
		// Not the error itself: it may quote the URL, password and all.
		return errors.New("--database-url: cannot parse it")
	}
	defer pool.Close()
	if _, err := migrations.Up(ctx, pool, *schema); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	if err := createTable(ctx, pool); err != nil {
		return err
	}

	var tp trace.TracerProvider
	if *tracing {
		provider, shutdown, err := otelenv.Setup(ctx, "orders", func(w string) { log.Warn("tracing: " + w) })
		if err != nil {
			return err
		}
		defer shutdown()
		tp = provider
	}
	mux, err := newMux(pool, *schema, log, tp)
	if err != nil {
		return err
	}

	// Expired keys (older than a day) are deleted in the background.
	purger, err := idempotency.NewPurger(pool, &idempotency.PurgeConfig{Schema: *schema, Logger: log})
	if err != nil {
		return err
	}
	// Its own context: run stops it on every return, an error's too, and
	// waits for it.
	purgeCtx, stopPurge := context.WithCancel(ctx)
	purged := make(chan struct{})
	go func() { defer close(purged); _ = purger.Run(purgeCtx) }()
	defer func() { stopPurge(); <-purged }()

	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	log.Info("orders: listening", "addr", ln.Addr().String())

	select {
	case err := <-served:
		return err
	case <-ctx.Done(): // SIGTERM or SIGINT: finish the requests in flight
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		return fmt.Errorf("shutdown: %w", err)
	}
	log.Info("orders: stopped")
	return nil
}

// newMux returns the service's routes. With tp, each request gets a server
// span, the idempotency outcome is recorded on it, and the trace context is
// written into the order's event (the three otelonceflow lines).
func newMux(pool *pgxpool.Pool, schema string, log *slog.Logger, tp trace.TracerProvider) (http.Handler, error) {
	// Transactional mode (the default): the key's claim, the order, its event
	// and the stored response commit together or not at all.
	mwCfg := &idempotency.Config{Schema: schema, Scope: user, Logger: log}
	outCfg := &outbox.Config{Schema: schema}
	if tp != nil {
		mwCfg.Hook = otelonceflow.NewHTTPHook()
		outCfg.Inject = otelonceflow.NewInjector()
	}
	mw, err := idempotency.New(pool, mwCfg)
	if err != nil {
		return nil, err
	}
	events, err := outbox.NewWriter(outCfg)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw.Handler(createOrder(events)))
	if tp == nil {
		return mux, nil
	}
	return otelhttp.NewHandler(mux, "orders", otelhttp.WithTracerProvider(tp),
		otelhttp.WithPropagators(propagation.TraceContext{})), nil
}

// user is the idempotency scope (Config.Scope, required): whose key a
// request carries. A real service takes it from its authentication; an error
// answers 401.
func user(r *http.Request) (string, error) {
	if u := r.Header.Get("X-User"); u != "" {
		return u, nil
	}
	return "", errors.New("X-User header required")
}

type orderRequest struct {
	Customer    string `json:"customer"`
	AmountCents int64  `json:"amount_cents"`
}

type order struct {
	OrderID     string `json:"order_id"`
	Customer    string `json:"customer"`
	AmountCents int64  `json:"amount_cents"`
}

// createOrder runs once per (user, Idempotency-Key). It writes through
// idempotency.Tx: the middleware commits that transaction together with the
// response it stores, so a retry can never create a second order.
func createOrder(events *outbox.Writer) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		var req orderRequest
		if err := decodeOne(r.Body, &req); err != nil {
			http.Error(w, "malformed JSON: "+err.Error(), http.StatusBadRequest)
			return
		}
		if req.Customer == "" || req.AmountCents <= 0 {
			http.Error(w, "customer and a positive amount_cents are required", http.StatusBadRequest)
			return
		}

		tx := idempotency.Tx(ctx)
		o := order{Customer: req.Customer, AmountCents: req.AmountCents}
		if err := tx.QueryRow(ctx, `INSERT INTO orders (customer, amount_cents) VALUES ($1, $2) RETURNING id::text`,
			o.Customer, o.AmountCents).Scan(&o.OrderID); err != nil {
			http.Error(w, "internal error", http.StatusInternalServerError) // 5xx: rolled back, the key is free again
			return
		}
		body, err := json.Marshal(o)
		if err != nil {
			http.Error(w, "internal error", http.StatusInternalServerError)
			return
		}
		// The event commits with the order, or neither does (G1).
		if err := events.Write(ctx, tx, outbox.Message{Topic: "orders", Key: []byte(o.OrderID), Value: body}); err != nil {
			http.Error(w, "internal error", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/orders/"+o.OrderID)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(body)
	})
}

// createTable creates orders if it is missing. Two processes running CREATE
// TABLE IF NOT EXISTS at once can still collide on the catalog's unique index,
// so they take turns on an advisory lock.
func createTable(ctx context.Context, pool *pgxpool.Pool) error {
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('onceflow-example-orders'))`); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (
			id           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
			customer     text NOT NULL,
			amount_cents bigint NOT NULL,
			created_at   timestamptz NOT NULL DEFAULT now()
		)`)
		return err
	})
	if err != nil {
		return fmt.Errorf("create orders: %w", err)
	}
	return nil
}

func envOr(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

// decodeOne decodes the one JSON value body holds into v: a decoder alone
// stops after the first value and ignores what follows it.
func decodeOne(body io.Reader, v any) error {
	dec := json.NewDecoder(body)
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("data after the JSON value")
	}
	return nil
}
