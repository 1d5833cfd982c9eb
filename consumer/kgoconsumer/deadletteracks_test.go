package kgoconsumer_test

import (
	"context"
	"crypto/rand"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// Dead letters are produced with the consumer's client, acks=all, and
// Config.ClientOpts says the options the Consumer depends on win over the
// user's. acks was not among them: ClientOpts shared with a fire-and-forget
// producer (kgo.RequiredAcks(kgo.NoAck()), kgo.DisableIdempotentWrite())
// made a dead letter the broker refused (here: too large for the
// dead-letter topic) silently dropped while the message's offset was
// committed (G6; cold review, helper 60). The Consumer's acks=all wins now:
// the dead letter is refused, shrunk to fit, and lands.
func TestClientOptsCannotTurnDeadLetterAcksOff(t *testing.T) {
	k := kafkatest.New(t)
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	topic := k.Topic(t, 1)
	limit := "100000"
	k.CreateTopic(t, topic+".dlq", 1, map[string]*string{"max.message.bytes": &limit})

	big := make([]byte, 150_000)
	_, _ = rand.Read(big)
	cl := k.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx,
		&kgo.Record{Topic: topic, Value: big, Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte("big")}}},
		&kgo.Record{Topic: topic, Value: []byte("ok"), Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte("ok")}}},
	).FirstErr(); err != nil {
		t.Fatal(err)
	}
	p, err := consumer.New(pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if len(m.Value) > 1000 {
			return consumer.Permanent(errors.New("cannot handle"))
		}
		return nil
	}, &consumer.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	c, err := kgoconsumer.New(p, &kgoconsumer.Config{
		Brokers: k.Brokers, Topics: []string{topic}, Group: "g",
		CommitInterval: 100 * time.Millisecond,
		ClientOpts: []kgo.Opt{
			kgo.MetadataMinAge(100 * time.Millisecond),
			kgo.FetchMaxWait(200 * time.Millisecond),
			kgo.RequiredAcks(kgo.NoAck()), kgo.DisableIdempotentWrite(),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	done := runInBackground(t, c)
	committed := waitCommitted(t, k, done, "g", topic, 2, 60*time.Second)
	dead := k.ReadAll(t, topic+".dlq", 1, 5*time.Second)
	if committed < 2 || len(dead) != 1 {
		t.Fatalf("committed offset %d, dead-letter topic holds %d records; want 2 and the one dead letter (a committed offset with none: the dead letter was lost)",
			committed, len(dead))
	}
}
