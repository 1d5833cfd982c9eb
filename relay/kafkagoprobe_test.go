package relay_test

import (
	"context"
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
)

// TestKafkaGoMissingTopicDoesNotStormConnections: a topic not
// created yet, with events written to it steadily (new keys, as orders
// arriving before the topic's deployment), for 4 s of its 1 min
// UnknownTopicGrace. Every relay round that carries one of its records now
// dials, handshakes and authenticates a connection of its own for the
// by-name probe.
func TestKafkaGoMissingTopicDoesNotStormConnections(t *testing.T) {
	b := setup(t)
	topic := b.kafka.Topic(t, 3)
	var dials atomic.Int64
	tr := &kafka.Transport{Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}}
	t.Cleanup(tr.CloseIdleConnections) // the caller's transport: Close leaves it open
	pub, err := kafkagopublisher.New(b.kafka.Brokers, &kafkagopublisher.Config{Transport: tr})
	if err != nil {
		t.Fatal(err)
	}
	b.startRelayWith(t, b.pool, pub, relay.Config{PollInterval: 250 * time.Millisecond})
	b.write(t, outbox.Message{Topic: topic, Key: []byte("warm"), Value: []byte("v")})
	time.Sleep(time.Second)
	warm := dials.Load()
	end := time.Now().Add(4 * time.Second)
	for i := 0; time.Now().Before(end); i++ {
		msgs := []outbox.Message{{Topic: "not-created-yet", Key: []byte(fmt.Sprint("order-", i)), Value: []byte("v")}}
		for j := 0; j < 50; j++ {
			msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint("k", i, "-", j)), Value: []byte("v")})
		}
		b.write(t, msgs...)
		time.Sleep(5 * time.Millisecond)
	}
	n := dials.Load() - warm
	t.Logf("4 s with a missing topic receiving an event every write of 51 (other events to an existing topic): %d new connections", n)
	if n > 10 {
		t.Errorf("a missing topic (within UnknownTopicGrace) made the relay dial %d connections in 4 s", n)
	}
}
