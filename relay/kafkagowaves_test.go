package relay_test

import (
	"bytes"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
)

// kafka-go publisher, a key's two events in two waves (BatchBytes): the
// first is answered "not authorized" (retried within TopicForbiddenGrace,
// an ACL being granted), and the ACL is granted before the second wave.
// The key's second event must not reach Kafka before its first (G3).
func TestKafkaGoKeyStopsAtAForbiddenAnswerAcrossWaves(t *testing.T) {
	b := setup(t)
	fake := b.kafka.RequireFake(t)
	topic := b.kafka.Topic(t, 1)
	pad := bytes.Repeat([]byte("x"), 900)
	b.write(t,
		outbox.Message{Topic: topic, Key: []byte("k"), Value: append([]byte("1"), pad...)},
		outbox.Message{Topic: topic, Key: []byte("k"), Value: append([]byte("2"), pad...)})
	h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.TopicAuthorizationFailed, Count: 1})
	defer h.Remove()
	pub, err := kafkagopublisher.New(b.kafka.Brokers, &kafkagopublisher.Config{BatchBytes: 1024})
	if err != nil {
		t.Fatal(err)
	}
	b.startRelayWith(t, b.pool, pub, relay.Config{PublishTimeout: 5 * time.Second})
	waitFor(t, "the outbox to drain", 60*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	if h.Hits() == 0 {
		t.Fatal("the fault was never hit; the test proves nothing")
	}
	all := b.kafka.ReadAll(t, topic, 2, 30*time.Second)
	if all[0].Value[0] != '1' {
		order := ""
		for _, r := range all {
			order += string(r.Value[:1])
		}
		t.Fatalf("key k's second event reached Kafka first (G3): first records %q", order)
	}
}
