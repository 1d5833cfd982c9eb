package relay_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// A relay whose connections lose the statements pgx prepared on them
// mid-run (what a pooler in transaction mode does to every transaction:
// another server connection, without them) stops with
// ErrPreparedStatementsLost instead of going on with Warn lines, failing
// most statements and publishing again every round it could not record.
// DEALLOCATE ALL on the relay's idle connections does to them what the
// pooler does.
func TestARelayWhoseConnectionsLoseTheirStatementsStops(t *testing.T) {
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
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	write := func(n int) {
		var msgs []outbox.Message
		for i := range n {
			msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint("k", i%5)), Value: []byte("v")})
		}
		b.write(t, msgs...)
	}
	write(20)
	waitFor(t, "the first events to be published", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })

	deadline := time.After(30 * time.Second)
	for stopped := false; !stopped; {
		for _, c := range pool.AcquireAllIdle(context.Background()) {
			_, err := c.Conn().PgConn().Exec(context.Background(), "DEALLOCATE ALL").ReadAll()
			c.Release()
			if err != nil {
				t.Fatal(err)
			}
		}
		write(5)
		select {
		case err = <-done:
			stopped = true
		case <-time.After(20 * time.Millisecond):
		case <-deadline:
			t.Fatal("the relay still runs 30 s after its connections began to lose their prepared statements")
		}
	}
	if !errors.Is(err, relay.ErrPreparedStatementsLost) {
		t.Fatalf("relay.Run returned %v, want relay.ErrPreparedStatementsLost", err)
	}
}
