package kafkagopublisher_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

// A topic the principal may not describe or write (an ACL not granted yet)
// is left out of an all-topics Metadata answer, as Kafka does, and its
// produce is refused with TOPIC_AUTHORIZATION_FAILED. The fault below has no
// Keys, so kfake applies it to both. kafka-go's Writer learns partitions
// from its Transport's all-topics metadata cache, so it never asks for the
// topic by name: it must still report ErrTopicForbidden (retried for
// TopicForbiddenGrace), not ErrUnknownTopic (UnknownTopicGrace), as the
// franz-go publisher does.
func TestTopicDeniedByACLIsForbiddenNotUnknown(t *testing.T) {
	k := kafkatest.New(t)
	fake := k.RequireFake(t)
	topic := k.Topic(t, 1)
	h := fake.Fault(kfake.Fault{Topic: topic, Err: kerr.TopicAuthorizationFailed, Count: -1})
	defer h.Remove()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rec := []relay.Record{{Topic: topic, Key: []byte("k"), Value: []byte("v")}}

	kg, err := kgopublisher.New(k.Brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer kg.Close()
	if err := kg.Publish(ctx, rec)[0]; !errors.Is(err, relay.ErrTopicForbidden) {
		t.Fatalf("franz-go publisher: %v, want ErrTopicForbidden (the fault does not model an ACL)", err)
	}

	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	p, err := kafkagopublisher.New(k.Brokers, &kafkagopublisher.Config{Transport: tr})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	err = p.Publish(ctx, rec)[0]
	if !errors.Is(err, relay.ErrTopicForbidden) {
		t.Fatalf("kafka-go publisher, topic denied by ACL: %v (unknown topic: %v), want ErrTopicForbidden",
			err, errors.Is(err, relay.ErrUnknownTopic))
	}
}
