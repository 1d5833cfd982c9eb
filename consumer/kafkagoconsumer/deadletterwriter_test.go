package kafkagoconsumer_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kafkagoconsumer"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// A dead-letter Writer built the usual kafka-go way (&kafka.Writer{Addr:
// ...}) has kafka-go's RequiredAcks none: WriteMessages returns nil even
// when the broker refuses the record, the message counts as dead-lettered
// and its offset is committed, so a refused dead letter was lost (cold
// review, helper 60: a too-large dead letter, gone). New refuses a Writer
// that does not wait for every in-sync replica, or writes asynchronously.
func TestNewRefusesADeadLetterWriterThatDoesNotWaitForEveryReplica(t *testing.T) {
	p, err := consumer.New(pgtest.Pool(t), "ledger", func(context.Context, pgx.Tx, consumer.Message) error { return nil },
		&consumer.Config{Schema: pgtest.Schema(t)})
	if err != nil {
		t.Fatal(err)
	}
	reader := kafka.ReaderConfig{Brokers: []string{"127.0.0.1:9092"}, GroupID: "g", GroupTopics: []string{"t"}}
	addr := kafka.TCP("127.0.0.1:9092")
	for name, tc := range map[string]struct {
		w    *kafka.Writer
		want string
	}{
		"kafka-go's default acks (none)": {&kafka.Writer{Addr: addr}, "RequiredAcks"},
		"leader only":                    {&kafka.Writer{Addr: addr, RequiredAcks: kafka.RequireOne}, "RequiredAcks"},
		"asynchronous":                   {&kafka.Writer{Addr: addr, RequiredAcks: kafka.RequireAll, Async: true}, "Async"},
	} {
		_, err := kafkagoconsumer.New(p, &kafkagoconsumer.Config{Reader: reader, DeadLetterWriter: tc.w})
		if err == nil || !strings.Contains(err.Error(), "DeadLetterWriter."+tc.want) {
			t.Errorf("%s: New: %v, want an error naming Config.DeadLetterWriter.%s", name, err, tc.want)
		}
	}
	ok := &kafka.Writer{Addr: addr, RequiredAcks: kafka.RequireAll}
	if _, err := kafkagoconsumer.New(p, &kafkagoconsumer.Config{Reader: reader, DeadLetterWriter: ok}); err != nil {
		t.Errorf("a Writer with RequiredAcks all: %v", err)
	}
}
