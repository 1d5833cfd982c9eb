package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
)

// kafka-go publisher, a topic whose ACL is not granted yet: Kafka leaves it
// out of all-topics Metadata and refuses its produce with
// TOPIC_AUTHORIZATION_FAILED (the fault, without Keys, does both). The
// relay must retry it for TopicForbiddenGrace (an ACL being granted is
// routine), not dead-letter it as an unknown topic after
// UnknownTopicGrace (G7).
func TestKafkaGoTopicDeniedByACLWaitsTopicForbiddenGrace(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fake := b.kafka.RequireFake(t)
	topic := b.kafka.Topic(t, 1)
	h := fake.Fault(kfake.Fault{Topic: topic, Err: kerr.TopicAuthorizationFailed, Count: -1})
	defer h.Remove()
	b.write(t, outbox.Message{Topic: topic, Key: []byte("k"), Value: []byte("v")})
	pub, err := kafkagopublisher.New(b.kafka.Brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	b.startRelayWith(t, b.pool, pub, relay.Config{
		TopicForbiddenGrace: time.Hour, UnknownTopicGrace: time.Second, MaxRetryBackoff: 200 * time.Millisecond})
	waitFor(t, "the fault to be hit", 30*time.Second, func() bool { return h.Hits() > 0 })
	// Five times UnknownTopicGrace, far inside TopicForbiddenGrace: the
	// event must stay pending all along.
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if b.count(t, "outbox_dead") != 0 {
			dead, err := relay.ListDead(context.Background(), b.pool, b.schema, 1)
			if err != nil {
				t.Fatal(err)
			}
			t.Fatalf("an event whose topic is not authorized yet was dead-lettered within TopicForbiddenGrace (1h), after %s: %q",
				dead[0].DeadAt.Sub(dead[0].CreatedAt).Round(100*time.Millisecond), dead[0].Error)
		}
	}
}
