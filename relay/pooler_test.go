package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// A relay connected to PostgreSQL itself whose connections lose their
// prepared statements (another user of a shared pool ran DEALLOCATE ALL or
// DISCARD ALL on them) goes on: pgx prepares them again. It used to stop
// with ErrPreparedStatementsLost at the third such error, which one
// DEALLOCATE ALL makes at once (every statement cached on the connection
// fails once). Only a pooler's connections stop it
// (internal/pgbouncertest).
func TestARelayWhoseOwnConnectionsLoseTheirStatementsGoesOn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 2)
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	r, err := relay.New(pool, b.publisher(t), &relay.Config{Schema: b.schema, PollInterval: 50 * time.Millisecond, LeaseDuration: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	written := 0
	write := func(n int) {
		var msgs []outbox.Message
		for i := range n {
			msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint("k", i%5)), Value: []byte("v")})
		}
		b.write(t, msgs...)
		written += n
	}
	write(20)
	waitFor(t, "the first events to be published", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	for range 10 {
		for _, c := range pool.AcquireAllIdle(context.Background()) {
			_, err := c.Conn().PgConn().Exec(context.Background(), "DEALLOCATE ALL").ReadAll()
			c.Release()
			if err != nil {
				t.Fatal(err)
			}
		}
		write(5)
		select {
		case err := <-done:
			t.Fatalf("relay.Run returned %v after its connections lost their statements", err)
		case <-time.After(100 * time.Millisecond):
		}
	}
	waitFor(t, "every event to be published", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	if got := b.kafka.ReadAll(t, topic, written, 30*time.Second); len(got) < written {
		t.Fatalf("read %d records, want %d", len(got), written)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("relay.Run: %v", err)
	}
}
