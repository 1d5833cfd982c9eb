package kafkagoconsumer_test

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kafkagoconsumer"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// TestDeadLetterOfALargeMessageKeepsItsValueWhenItsTopicTakesIt (cold
// review, helper 96): kgoconsumer's test of that name, for this adapter.
// The default dead-letter Writer kept kafka-go's BatchBytes (1 MiB), so
// the dead letter of a 2 MiB message went out without its value although
// its topic takes 8 MiB records.
func TestDeadLetterOfALargeMessageKeepsItsValueWhenItsTopicTakesIt(t *testing.T) {
	k := kafkatest.New(t)
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	limit := "8388608"
	topic := "dlq-large-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	big := map[string]*string{"max.message.bytes": &limit}
	k.CreateTopic(t, topic, 1, big)
	k.CreateTopic(t, topic+".dlq", 1, big)

	value := bytes.Repeat([]byte("v"), 2<<20)
	cl := k.Client(t, kgo.ProducerBatchMaxBytes(8<<20), kgo.ProducerBatchCompression(kgo.NoCompression()))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx,
		&kgo.Record{Topic: topic, Key: []byte("k"), Value: value, Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte("big")}}},
	).FirstErr(); err != nil {
		t.Fatal(err)
	}
	p, err := consumer.New(pool, "large", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return consumer.Permanent(errors.New("cannot apply"))
	}, &consumer.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	c, err := kafkagoconsumer.New(p, &kafkagoconsumer.Config{Reader: kafka.ReaderConfig{
		Brokers: k.Brokers, GroupID: "g-" + topic, GroupTopics: []string{topic}, MaxWait: 200 * time.Millisecond,
	}, CommitInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	defer func() { stop(); <-done }()
	dead := k.ReadAll(t, topic+".dlq", 1, 30*time.Second)
	if len(dead) != 1 {
		t.Fatalf("dead-letter topic holds %d records; want 1", len(dead))
	}
	omitted := ""
	for _, h := range dead[0].Headers {
		if h.Key == consumer.HeaderDLQValueOmitted {
			omitted = string(h.Value)
		}
	}
	if len(dead[0].Value) != len(value) {
		t.Errorf("dead letter holds a value of %d bytes (%s=%q), want the message's %d: its topic takes %s bytes",
			len(dead[0].Value), consumer.HeaderDLQValueOmitted, omitted, len(value), limit)
	}
}

// TestDeadLettersToOneTopicAreJudgedAlone: two messages of 600 KB, on two
// partitions, dead-lettered at the same moment to a topic that takes 1 MiB
// records (Kafka's default). Sent together they would share a record batch
// of 1.2 MB, which the topic refuses whole, and both would lose their
// value; one at a time, each is judged alone and keeps it.
func TestDeadLettersToOneTopicAreJudgedAlone(t *testing.T) {
	k := kafkatest.New(t)
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	topic := "dlq-alone-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	limit := "1048588"
	k.CreateTopic(t, topic, 2, nil)
	k.CreateTopic(t, topic+".dlq", 1, map[string]*string{"max.message.bytes": &limit})
	value := bytes.Repeat([]byte("v"), 600<<10)
	cl := k.Client(t, kgo.ProducerBatchCompression(kgo.NoCompression()), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for p := range int32(2) {
		id := []byte(strconv.Itoa(int(p)))
		if err := cl.ProduceSync(ctx, &kgo.Record{Topic: topic, Partition: p, Value: value,
			Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: id}}}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	var arrived sync.WaitGroup
	arrived.Add(2)
	both := make(chan struct{})
	go func() { arrived.Wait(); close(both) }()
	var once sync.Map
	p, err := consumer.New(pool, "alone", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if _, again := once.LoadOrStore(m.Partition, true); !again {
			arrived.Done()
		}
		select { // fail both at once
		case <-both:
		case <-time.After(10 * time.Second):
		}
		return consumer.Permanent(errors.New("cannot apply"))
	}, &consumer.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	c, err := kafkagoconsumer.New(p, &kafkagoconsumer.Config{Reader: kafka.ReaderConfig{
		Brokers: k.Brokers, GroupID: "g-" + topic, GroupTopics: []string{topic}, MaxWait: 200 * time.Millisecond,
	}, CommitInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	defer func() { stop(); <-done }()
	dead := k.ReadAll(t, topic+".dlq", 2, 30*time.Second)
	if len(dead) != 2 {
		t.Fatalf("dead-letter topic holds %d records; want 2", len(dead))
	}
	for _, d := range dead {
		if len(d.Value) != len(value) {
			t.Errorf("a dead letter holds a value of %d bytes, want the message's %d: alone it fits its topic's %s", len(d.Value), len(value), limit)
		}
	}
}
