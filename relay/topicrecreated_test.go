package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
)

// An operator deletes a topic and creates it again under the same name (to
// purge it, or an IaC tool replacing it) while the relay runs. Events
// written after the new topic serves its partitions must be published to
// it, in key order, and none dead-lettered: the topic exists (G7
// dead-letters an unknown topic only while it stays unknown). Kafka 4's
// Produce names topics by id, and franz-go does not adopt a recreated
// topic's new id by itself (kgo.Client.PurgeTopicsFromProducing is the
// caller's job): every record of the topic failed with UNKNOWN_TOPIC_ID for
// as long as the relay process lived, and all were dead-lettered after
// UnknownTopicGrace (cold review, helper 61). kfake and Apache Kafka (CI's
// Kafka run takes tests named OnARealBroker) both show it. The kafka-go
// publisher is checked alike.
func TestRecreatedTopicIsPublishedToOnARealBroker(t *testing.T) {
	t.Run("franz-go", func(t *testing.T) {
		b := setup(t)
		recreatedTopicIsPublishedTo(t, b, b.publisher(t))
	})
	t.Run("kafka-go", func(t *testing.T) {
		b := setup(t)
		pub, err := kafkagopublisher.New(b.kafka.Brokers, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = pub.Close() })
		recreatedTopicIsPublishedTo(t, b, pub)
	})
}

func recreatedTopicIsPublishedTo(t *testing.T, b *bundle, pub relay.Publisher) {
	topic := b.kafka.Topic(t, 2)
	ctx := context.Background()
	write := func(n int, tag string) (ids []string, keyOf map[string]string) {
		keyOf = map[string]string{}
		var msgs []outbox.Message
		for i := range n {
			id, k := outbox.NewID(), fmt.Sprint("k", i%10)
			ids, keyOf[id] = append(ids, id), k
			msgs = append(msgs, outbox.Message{ID: id, Topic: topic, Key: []byte(k), Value: []byte(fmt.Sprint(tag, i))})
		}
		b.write(t, msgs...)
		return ids, keyOf
	}
	write(100, "before")
	b.startRelayWith(t, b.pool, pub, relay.Config{UnknownTopicGrace: 5 * time.Second})
	waitFor(t, "the first events to be published", time.Minute, func() bool { return b.count(t, "outbox") == 0 })

	// The operator recreates the topic.
	adm := b.kafka.Admin(t)
	if resp, err := adm.DeleteTopic(ctx, topic); err != nil || resp.Err != nil {
		t.Fatalf("delete topic: %v %v", err, resp.Err)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		md, err := adm.Metadata(ctx, topic)
		if err == nil {
			if d, ok := md.Topics[topic]; ok && d.Err != nil {
				break // gone
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("topic not deleted within 1m")
		}
		time.Sleep(100 * time.Millisecond)
	}
	b.kafka.CreateTopic(t, topic, 2, nil) // waits until its partitions are served
	recreated := time.Now()

	ids, keyOf := write(100, "after")
	// Well past UnknownTopicGrace (5 s).
	deadline = time.Now().Add(45 * time.Second)
	for b.count(t, "outbox") > 0 && b.count(t, "outbox_dead") == 0 && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if dead := b.count(t, "outbox_dead"); dead > 0 {
		var e string
		_ = b.pool.QueryRow(ctx, `SELECT error FROM `+pgx.Identifier{b.schema, "outbox_dead"}.Sanitize()+` ORDER BY id LIMIT 1`).Scan(&e)
		time.Sleep(10 * time.Second) // let the rest follow
		t.Fatalf("%s after topic %s was recreated (and served), %d of the 100 events written to it since were dead-lettered, %d still pending; first error: %s",
			time.Since(recreated).Round(time.Second), topic, b.count(t, "outbox_dead"), b.count(t, "outbox"), e)
	}
	if n := b.count(t, "outbox"); n > 0 {
		t.Fatalf("%d of the 100 events written to the recreated topic %s still pending %s after it was recreated", n, topic, time.Since(recreated).Round(time.Second))
	}
	checkDelivery(t, ids, keyOf, b.kafka.ReadAll(t, topic, len(ids), time.Minute))
}
