package relay_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

// An event to a topic that does not exist costs only its own key: with the
// franz-go client's defaults (as the binary runs it: metadata refreshed at
// most every 5 s), the events of other keys written after it are published
// at once, not after the client's unknown-topic retries.
func TestUnknownTopicCostsOnlyItsKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	healthy := b.kafka.Topic(t, 2)
	b.write(t, outbox.Message{Topic: "no-such-topic", Key: []byte("u"), Value: []byte("lost?")})
	const n = 200
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = outbox.Message{Topic: healthy, Key: []byte(fmt.Sprint(i % 7)), Value: []byte(fmt.Sprint(i))}
	}
	b.write(t, msgs...)
	pub, err := kgopublisher.New(b.kafka.Brokers, nil) // the client's defaults
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	b.startRelayWith(t, b.pool, pub, relay.Config{})
	// Generous for a loaded machine, and still well under what the
	// client's retries cost (two metadata refreshes at least 5 s apart).
	deadline := time.Now().Add(8 * time.Second)
	for b.count(t, "outbox") > 1 {
		if time.Now().After(deadline) {
			t.Fatalf("%d events of other keys still pending after 8s beside one unknown topic", b.count(t, "outbox")-1)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("other keys published and recorded in %s", time.Since(start))
	// Nor do later rounds, while the unknown topic's event is retried.
	const batches = 8
	for range batches {
		b.write(t, msgs...)
		again := time.Now()
		for b.count(t, "outbox") > 1 {
			if time.Since(again) > 8*time.Second {
				t.Fatalf("%d events of a later round still pending after 8s beside one unknown topic", b.count(t, "outbox")-1)
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Logf("a later round in %s", time.Since(again))
		time.Sleep(500 * time.Millisecond) // let the unknown topic's event be retried
	}
	if d := b.count(t, "outbox_dead"); d != 0 {
		t.Fatalf("the unknown topic's event was dead-lettered before its grace")
	}
}
