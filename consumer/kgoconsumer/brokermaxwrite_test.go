package kgoconsumer_test

import (
	"context"
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

// TestDeadLetterLimitYieldsToBrokerMaxWriteBytes: franz-go's docs say to
// keep kgo.BrokerMaxWriteBytes in sync with the brokers'
// socket.request.max.bytes; a cluster that lowered it to 32 MiB passes
// kgo.BrokerMaxWriteBytes(32 << 20) in ClientOpts. franz-go refuses a
// client whose batch limit (the adapter's 64 MiB for dead letters) is above
// its write limit ("max broker write bytes 33554432 is erroneously less
// than max record batch bytes 67108864"): the adapter's limit must yield to
// the user's, and Run start and consume.
func TestDeadLetterLimitYieldsToBrokerMaxWriteBytes(t *testing.T) {
	k := kafkatest.New(t)
	topic := k.Topic(t, 1)
	cl := k.Client(t)
	if err := cl.ProduceSync(context.Background(), &kgo.Record{Topic: topic, Value: []byte("v"),
		Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte(strconv.Itoa(1))}}}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	p, err := consumer.New(pgtest.Pool(t), "bmwb", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return nil
	}, &consumer.Config{Schema: pgtest.Schema(t)})
	if err != nil {
		t.Fatal(err)
	}
	c, err := kgoconsumer.New(p, &kgoconsumer.Config{Brokers: k.Brokers, Topics: []string{topic}, Group: "g",
		CommitInterval: 100 * time.Millisecond, ClientOpts: []kgo.Opt{kgo.BrokerMaxWriteBytes(32 << 20)}})
	if err != nil {
		t.Fatal(err)
	}
	done := runInBackground(t, c)
	if got := waitCommitted(t, k, done, "g", topic, 1, 20*time.Second); got != 1 {
		t.Fatalf("committed offset %d after 20 s, want 1", got)
	}
}
