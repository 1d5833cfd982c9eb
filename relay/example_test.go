package relay_test

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

// Run a relay: committed events reach Kafka with their message-id, and the
// outbox empties.
func ExampleRelay_Run() {
	ctx := context.Background()
	url := os.Getenv("ONCEFLOW_TEST_DATABASE_URL")
	if url == "" {
		url = pgtest.DefaultURL
	}
	pool, _ := pgxpool.New(ctx, url)
	defer pool.Close()
	schema := pgtest.NewSchemaName() // "onceflow" in production
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		panic(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")

	kafka, _ := kfake.NewCluster(kfake.SeedTopics(1, "orders"))
	defer kafka.Close()

	writer, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
	_ = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return writer.Write(ctx, tx, outbox.Message{ID: "6f1c2a4e-0d3b-4c5a-9e8f-7a6b5c4d3e2f", Topic: "orders", Key: []byte("o-1"), Value: []byte("created")})
	})

	pub, _ := kgopublisher.New(kafka.ListenAddrs(), nil)
	defer pub.Close()
	r, _ := relay.New(pool, pub, &relay.Config{Schema: schema})
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- r.Run(runCtx) }()

	cl, _ := kgo.NewClient(kgo.SeedBrokers(kafka.ListenAddrs()...), kgo.ConsumeTopics("orders"))
	defer cl.Close()
	pollCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	rec := cl.PollFetches(pollCtx).Records()[0]
	fmt.Printf("%s %s message-id=%s\n", rec.Key, rec.Value, rec.Headers[0].Value)

	// The relay deletes the event once Kafka's acknowledgement is in.
	st, _ := relay.ReadStatus(ctx, pool, schema)
	for deadline := time.Now().Add(30 * time.Second); st.Backlog > 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
		st, _ = relay.ReadStatus(ctx, pool, schema)
	}
	fmt.Println("backlog:", st.Backlog)
	stop()
	<-done
	// Output:
	// o-1 created message-id=6f1c2a4e-0d3b-4c5a-9e8f-7a6b5c4d3e2f
	// backlog: 0
}
