package kgoconsumer_test

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// TestDeadLetterOfALargeMessageKeepsItsValueWhenItsTopicTakesIt (cold
// review, helper 96): a topic made for 2 MiB messages, and its dead-letter
// topic beside it with the same max.message.bytes (8 MiB). The consumer
// reads the 2 MiB message fine with the defaults, and its dead letter
// went out without the message's value: the group client's own produce
// limit (franz-go's ProducerBatchMaxBytes, 1,000,012 bytes by default)
// refused it as MESSAGE_TOO_LARGE, and the Processor took that for the
// topic's refusal and dropped the payload. README: a dead letter goes out without
// the original's value when "its topic refuses" it for its size; this
// topic would take it. The payload is then only in the consumed topic,
// until its retention deletes it.
func TestDeadLetterOfALargeMessageKeepsItsValueWhenItsTopicTakesIt(t *testing.T) {
	k := kafkatest.New(t)
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	limit := "8388608"
	topic := "h101-large-" + strconv.FormatInt(time.Now().UnixNano(), 36)
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
	seen := make(chan int, 1)
	p, err := consumer.New(pool, "large", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		select {
		case seen <- len(m.Value):
		default:
		}
		return consumer.Permanent(errors.New("cannot apply"))
	}, &consumer.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	c, err := kgoconsumer.New(p, &kgoconsumer.Config{
		Brokers: k.Brokers, Topics: []string{topic}, Group: "g",
		CommitInterval: 100 * time.Millisecond,
		ClientOpts:     []kgo.Opt{kgo.MetadataMinAge(100 * time.Millisecond), kgo.FetchMaxWait(200 * time.Millisecond)},
	})
	if err != nil {
		t.Fatal(err)
	}
	done := runInBackground(t, c)
	if committed := waitCommitted(t, k, done, "g", topic, 1, 30*time.Second); committed < 1 {
		t.Fatalf("committed offset %d after 30s; want 1 (the message dead-lettered)", committed)
	}
	t.Logf("the handler saw a value of %d bytes", <-seen)
	dead := k.ReadAll(t, topic+".dlq", 1, 10*time.Second)
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
