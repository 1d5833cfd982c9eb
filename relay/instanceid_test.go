package relay_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// A second relay started under the InstanceID of a live one refuses to
// start with an error that says so, instead of owning every shard beside it
// and publishing every event twice.
func TestSecondRelayWithSameInstanceIDRefusesToStart(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 2)
	b.startRelay(t, relay.Config{InstanceID: "same"})
	waitFor(t, "the first relay to own its shards", 20*time.Second, func() bool {
		st, err := relay.ReadStatus(context.Background(), b.pool, b.schema)
		return err == nil && st.UnownedShards == 0
	})

	pub := b.publisher(t)
	defer pub.Close()
	second, err := relay.New(b.pool, pub, &relay.Config{Schema: b.schema, InstanceID: "same", LeaseDuration: time.Second, PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- second.Run(ctx) }()

	const n = 500
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = outbox.Message{Topic: topic, Key: []byte(fmt.Sprint(i % 13)), Value: []byte(fmt.Sprint(i))}
	}
	b.write(t, msgs...)

	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "instance id") || !strings.Contains(err.Error(), `"same"`) {
			t.Fatalf("second relay's Run: %v; want an error naming the instance id in use", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a second relay under the same InstanceID is still running after 30s")
	}
	waitFor(t, "the outbox to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	if got := b.kafka.ReadAll(t, topic, n+1, 3*time.Second); len(got) != n {
		t.Fatalf("%d records for %d events: the same instance id published twice", len(got), n)
	}
	st, err := relay.ReadStatus(context.Background(), b.pool, b.schema)
	if err != nil || st.UnownedShards != 0 {
		t.Fatalf("the first relay lost its shards: %+v, %v", st, err)
	}
}
