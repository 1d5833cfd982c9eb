package relay_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// A schema migrated down under a running relay (an operator rolling back
// before stopping the relays) must stop the relay with an error naming the
// missing migrations, as at its start, not leave it running, ready by its
// probes, with every statement failing as if the database were away.
func TestARelayStopsWhenItsSchemaIsMigratedDownUnderIt(t *testing.T) {
	t.Parallel()
	b := setup(t)
	r, err := relay.New(b.pool, b.publisher(t), &relay.Config{Schema: b.schema, PollInterval: 50 * time.Millisecond, LeaseDuration: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	b.write(t, outbox.Message{Topic: b.kafka.Topic(t, 1), Key: []byte("k"), Value: []byte("v")})
	waitFor(t, "the event to be published", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })

	if _, err := migrations.Down(context.Background(), b.pool, b.schema, migrations.Latest()-2); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		var missing *migrations.MissingError
		if !errors.As(err, &missing) || !strings.Contains(err.Error(), "migrate up") {
			t.Fatalf("Run returned %v, want the missing migrations named", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the relay still runs 30s after its schema was migrated down under it")
	}
}
