package kgoconsumer_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// A dead letter is shrunk until it fits its topic: the original's value,
// then its headers, then its key. The error header it adds is kept up to
// 8 KiB, and a handler's error that long (a wrapped payload) against a
// dead-letter topic with a small max.message.bytes left a dead letter that
// still did not fit after every step: its partition waited for good (G6;
// helper 60's note, confirmed here). The error header is cut further as a
// last step; the origin headers still say where the message lies.
func TestDeadLetterWithLongErrorFitsSmallTopic(t *testing.T) {
	k := kafkatest.New(t)
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	topic := k.Topic(t, 1)
	limit := "1500"
	k.CreateTopic(t, topic+".dlq", 1, map[string]*string{"max.message.bytes": &limit})

	cl := k.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx,
		&kgo.Record{Topic: topic, Key: []byte("k"), Value: []byte("poison"), Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte("poison")}}},
		&kgo.Record{Topic: topic, Key: []byte("k"), Value: []byte("ok"), Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte("ok")}}},
	).FirstErr(); err != nil {
		t.Fatal(err)
	}
	// 9,600 bytes that do not compress (the broker checks a batch's size
	// compressed).
	raw := make([]byte, 4800)
	_, _ = rand.Read(raw)
	long := hex.EncodeToString(raw)
	p, err := consumer.New(pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if string(m.Value) == "poison" {
			return consumer.Permanent(errors.New("cannot handle: " + long))
		}
		return nil
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
	if committed := waitCommitted(t, k, done, "g", topic, 2, 30*time.Second); committed < 2 {
		t.Fatalf("committed offset %d after 30s; want 2 (the poison message dead-lettered, the next handled)", committed)
	}
	dead := k.ReadAll(t, topic+".dlq", 1, 5*time.Second)
	if len(dead) != 1 {
		t.Fatalf("dead-letter topic holds %d records; want 1", len(dead))
	}
	headers := map[string]string{}
	for _, h := range dead[0].Headers {
		headers[h.Key] = string(h.Value)
	}
	if e := headers[consumer.HeaderDLQError]; !strings.Contains(e, "cannot handle: "+long[:64]) || len(e) > 1000 {
		t.Errorf("error header of %d bytes: %.80q", len(e), e)
	}
	if headers[consumer.HeaderDLQOffset] != "0" || headers[consumer.HeaderDLQTopic] != topic || headers[consumer.MessageIDHeader] != "poison" {
		t.Errorf("dead letter lost its origin: %v", headers)
	}
}
