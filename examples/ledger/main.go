// Command ledger is a Kafka worker built on onceflow's idempotent consumer.
// It reads payment events and adds each amount to an account balance, once
// per message id, however often Kafka delivers the event.
//
//	go run ./examples/ledger --database-url URL --brokers ADDR --topic payments --group ledger
//
// An event is JSON: {"account":"a1","amount_cents":250}, with a "message-id"
// header (onceflow's relay sets one on every event). Balances live in
// ledger_accounts, in the connection's default schema.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/internal/otelenv"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/otelonceflow"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := run(ctx, os.Args[1:], log); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "ledger:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, log *slog.Logger) error {
	fs := flag.NewFlagSet("ledger", flag.ContinueOnError)
	// No defaults from the environment: --help prints them, and the URL
	// may hold the password. Read after Parse.
	dbURL := fs.String("database-url", "", "PostgreSQL URL (env ONCEFLOW_DATABASE_URL)")
	brokers := fs.String("brokers", "", "Kafka brokers, comma-separated host:port (env ONCEFLOW_BROKERS)")
	schema := fs.String("schema", envOr("ONCEFLOW_SCHEMA", migrations.DefaultSchema), "schema holding onceflow's tables (env ONCEFLOW_SCHEMA)")
	topic := fs.String("topic", "payments", "topic to consume")
	group := fs.String("group", "ledger", "consumer group, also the name payments are deduplicated under")
	window := fs.Duration("dedup-window", consumer.DefaultDedupWindow, "keep dedup records this long; must exceed how long the topic can keep a record (retention.ms plus segment.ms)")
	session := fs.Duration("session-timeout", 0, "group session timeout: how soon a worker that died gives up its partitions (0: franz-go's 45s)")
	rebalance := fs.Duration("rebalance-timeout", 0, "group rebalance timeout (0: franz-go's 60s)")
	tracing := fs.Bool("trace", false, "trace each payment in a consumer span joined to its producer's trace (the record's traceparent header); spans are exported as the standard OTEL_* environment variables say (OTEL_EXPORTER_OTLP_ENDPOINT, ...)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dbURL == "" {
		*dbURL = os.Getenv("ONCEFLOW_DATABASE_URL")
	}
	if *brokers == "" {
		*brokers = os.Getenv("ONCEFLOW_BROKERS")
	}
	if *dbURL == "" || *brokers == "" {
		return errors.New("--database-url and --brokers are required")
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

	// Without its dead-letter topic a payment that cannot be applied would
	// stop its partition until someone creates it (the consumer waits
	// rather than drop the message): create it here, as the tables above.
	createDeadLetterTopic(ctx, strings.Split(*brokers, ","), *topic+".dlq", log)

	cfg := &consumer.Config{Schema: *schema, Logger: log}
	if *tracing {
		tp, shutdown, err := otelenv.Setup(ctx, "ledger", func(w string) { log.Warn("tracing: " + w) })
		if err != nil {
			return err
		}
		defer shutdown()
		cfg.Hooks = append(cfg.Hooks, otelonceflow.NewConsumer(otelonceflow.WithTracerProvider(tp), otelonceflow.WithConsumerGroup(*group)))
	}
	p, err := consumer.New(pool, *group, addPayment, cfg)
	if err != nil {
		return err
	}
	var opts []kgo.Opt
	if *session > 0 {
		opts = append(opts, kgo.SessionTimeout(*session), kgo.HeartbeatInterval(min(3*time.Second, *session/5)))
	}
	if *rebalance > 0 {
		opts = append(opts, kgo.RebalanceTimeout(*rebalance))
	}
	c, err := kgoconsumer.New(p, &kgoconsumer.Config{
		Brokers:    strings.Split(*brokers, ","),
		Topics:     []string{*topic},
		Group:      *group,
		Logger:     log,
		ClientOpts: opts,
	})
	if err != nil {
		return err
	}
	// The janitor deletes dedup records older than the window, so
	// processed_messages does not grow forever. Every worker may run one.
	janitor, err := consumer.NewJanitor(pool, &consumer.JanitorConfig{Schema: *schema, Window: *window, Logger: log})
	if err != nil {
		return err
	}
	janitorDone := make(chan struct{})
	janitorCtx, stopJanitor := context.WithCancel(ctx)
	go func() { defer close(janitorDone); _ = janitor.Run(janitorCtx) }()
	defer func() { stopJanitor(); <-janitorDone }()

	log.Info("ledger: consuming", "topic", *topic, "group", *group, "dedup_window", window.String())
	if err := c.Run(ctx); err != nil { // returns nil once ctx is canceled (SIGTERM, SIGINT)
		return err
	}
	log.Info("ledger: stopped")
	return nil
}

// payment is the event this worker consumes.
type payment struct {
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
}

// addPayment is the handler. It runs inside the transaction that records the
// message id, so the balance changes at most once per message id. A payment
// that cannot be decoded will never succeed: Permanent sends it straight to the
// dead-letter topic (<topic>.dlq) instead of retrying.
func addPayment(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
	var p payment
	if err := json.Unmarshal(msg.Value, &p); err != nil {
		return consumer.Permanent(fmt.Errorf("decode payment: %w", err))
	}
	if p.Account == "" {
		return consumer.Permanent(errors.New("decode payment: no account"))
	}
	_, err := tx.Exec(ctx, `INSERT INTO ledger_accounts (account, balance_cents) VALUES ($1, $2)
		ON CONFLICT (account) DO UPDATE SET balance_cents = ledger_accounts.balance_cents + excluded.balance_cents`,
		p.Account, p.AmountCents)
	return err
}

// createTable creates ledger_accounts if it is missing. Two processes running
// CREATE TABLE IF NOT EXISTS at once can still collide on the catalog's unique
// index, so they take turns on an advisory lock.
func createTable(ctx context.Context, pool *pgxpool.Pool) error {
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('onceflow-example-ledger'))`); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS ledger_accounts (
			account       text PRIMARY KEY,
			balance_cents bigint NOT NULL
		)`)
		return err
	})
	if err != nil {
		return fmt.Errorf("create ledger_accounts: %w", err)
	}
	return nil
}

// createDeadLetterTopic creates topic with the broker's default partitions
// and replication unless it exists. Failing that (no CREATE on the cluster,
// the broker not up yet) it logs and goes on: the topic may be created by
// hand, and the consumer waits for the broker.
func createDeadLetterTopic(ctx context.Context, brokers []string, topic string, log *slog.Logger) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err == nil {
		defer cl.Close()
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		_, err = kadm.NewClient(cl).CreateTopic(ctx, -1, -1, nil, topic)
	}
	switch {
	case err == nil:
		log.Info("ledger: created the dead-letter topic", "topic", topic)
	case errors.Is(err, kerr.TopicAlreadyExists):
	default:
		log.Warn("ledger: could not create the dead-letter topic; a payment that cannot be applied will stop its partition until it exists", "topic", topic, "error", err)
	}
}

func envOr(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}
