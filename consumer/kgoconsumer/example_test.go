package kgoconsumer_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// A ledger worker: each payment event adds to an account balance, and a
// payment delivered twice is counted once.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	// A database with onceflow's tables and a ledger, and a Kafka (in
	// process here) holding the same payment event twice.
	url := os.Getenv("ONCEFLOW_TEST_DATABASE_URL")
	if url == "" {
		url = pgtest.DefaultURL
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	schema := pgtest.NewSchemaName()
	defer pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		panic(err)
	}
	ledger := pgx.Identifier{schema, "ledger_accounts"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+ledger+` (account text PRIMARY KEY, balance_cents bigint NOT NULL)`); err != nil {
		panic(err)
	}
	kafka, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "payments"), kfake.GroupMinSessionTimeout(100*time.Millisecond))
	if err != nil {
		panic(err)
	}
	defer kafka.Close()
	producer, _ := kgo.NewClient(kgo.SeedBrokers(kafka.ListenAddrs()...))
	defer producer.Close()
	event := &kgo.Record{Topic: "payments", Value: []byte(`{"account":"a1","amount_cents":250}`),
		Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte("7f1d8a52-5b7e-4a37-9d7c-0d6f1c1f0c11")}}}
	again := *event
	if err := producer.ProduceSync(ctx, event, &again).FirstErr(); err != nil {
		panic(err)
	}

	// The handler writes through tx: its effect commits with the dedup
	// record, once per message id.
	handle := func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		var p struct {
			Account     string `json:"account"`
			AmountCents int64  `json:"amount_cents"`
		}
		if err := json.Unmarshal(msg.Value, &p); err != nil {
			return consumer.Permanent(fmt.Errorf("decode payment: %w", err))
		}
		_, err := tx.Exec(ctx, `INSERT INTO `+ledger+` (account, balance_cents) VALUES ($1, $2)
			ON CONFLICT (account) DO UPDATE SET balance_cents = `+ledger+`.balance_cents + excluded.balance_cents`,
			p.Account, p.AmountCents)
		return err
	}
	runCtx, stop := context.WithCancel(ctx)
	var finished atomic.Int32
	p, err := consumer.New(pool, "ledger", handle, &consumer.Config{
		Schema: schema,
		Hooks: []consumer.Hook{doneHook(func(e consumer.DoneEvent) {
			fmt.Println(e.Outcome)
			if finished.Add(1) == 2 {
				stop() // this example stops after two messages
			}
		})},
	})
	if err != nil {
		panic(err)
	}
	c, err := kgoconsumer.New(p, &kgoconsumer.Config{
		Brokers: kafka.ListenAddrs(),
		Topics:  []string{"payments"},
	})
	if err != nil {
		panic(err)
	}
	if err := c.Run(runCtx); err != nil {
		panic(err)
	}

	var balance int64
	if err := pool.QueryRow(ctx, `SELECT balance_cents FROM `+ledger+` WHERE account = 'a1'`).Scan(&balance); err != nil {
		panic(err)
	}
	fmt.Println("a1:", balance)
	// Output:
	// processed
	// duplicate
	// a1: 250
}

type doneHook func(consumer.DoneEvent)

func (f doneHook) OnDone(e consumer.DoneEvent) { f(e) }
