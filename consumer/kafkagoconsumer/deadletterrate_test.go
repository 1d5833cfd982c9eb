package kafkagoconsumer_test

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
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

// TestDeadLettersOfManyPartitionsGoOutTogether: 8 partitions dead-letter
// 50 permanently failing messages each (a poison deploy, a schema change)
// to one topic. Their publishes must share the default Writer's batches:
// one at a time per topic, each waited out the Writer's 5 ms BatchTimeout
// alone, and the whole consumer dead-lettered at about 155/s whatever its
// partitions (kfake, this machine), against about 1,050/s together.
func TestDeadLettersOfManyPartitionsGoOutTogether(t *testing.T) {
	k := kafkatest.New(t)
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	topic := "rate-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	const parts, per = 8, 50
	k.CreateTopic(t, topic, parts, nil)
	k.CreateTopic(t, topic+".dlq", parts, nil)
	cl := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	var recs []*kgo.Record
	for p := range int32(parts) {
		for i := 0; i < per; i++ {
			recs = append(recs, &kgo.Record{Topic: topic, Partition: p, Key: []byte(strconv.Itoa(i)), Value: []byte("v"),
				Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte(strconv.Itoa(int(p)*1000 + i))}}})
		}
	}
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	p, err := consumer.New(pool, "rate", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return consumer.Permanent(errors.New("cannot apply"))
	}, &consumer.Config{Schema: schema, Logger: slog.New(slog.DiscardHandler)}) // 400 dead letters, each logged at Error
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
	start := time.Now()
	go func() { done <- c.Run(rctx) }()
	defer func() { stop(); <-done }()
	dead := k.ReadAll(t, topic+".dlq", parts*per, 60*time.Second)
	el := time.Since(start)
	rate := float64(len(dead)) / el.Seconds()
	t.Logf("%d dead letters in %s: %.0f/s", len(dead), el.Round(time.Millisecond), rate)
	if len(dead) < parts*per || rate < 400 {
		t.Errorf("%d of %d dead letters in %s (%.0f/s, want 400/s at least): are the partitions' dead letters published one at a time, each behind the Writer's BatchTimeout?",
			len(dead), parts*per, el.Round(time.Millisecond), rate)
	}
}
