package outbox_test

import (
	"context"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
)

// Write a business row and the event about it in one transaction.
func ExampleWrite() {
	ctx := context.Background()
	url := os.Getenv("ONCEFLOW_TEST_DATABASE_URL")
	if url == "" {
		url = pgtest.DefaultURL
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	schema := pgtest.NewSchemaName() // "onceflow" in production
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		panic(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	writer, _ := outbox.NewWriter(&outbox.Config{Schema: schema})

	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `CREATE TEMP TABLE orders (id text PRIMARY KEY, amount_cents bigint)`); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO orders VALUES ('o-1', 500)`); err != nil {
			return err
		}
		return writer.Write(ctx, tx, outbox.Message{
			Topic: "orders",
			Key:   []byte("o-1"),
			Value: []byte(`{"order_id":"o-1","amount_cents":500}`),
		})
	})
	if err != nil {
		panic(err)
	}

	var backlog int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "outbox"}.Sanitize()).Scan(&backlog)
	fmt.Println("events waiting for the relay:", backlog)
	// Output: events waiting for the relay: 1
}
