package kafkagoconsumer_test

import (
	"os"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"go.uber.org/goleak"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/internal/conformance"
	"github.com/onceflow/onceflow/consumer/kafkagoconsumer"
)

var adapter = conformance.Adapter{
	New: func(p *consumer.Processor, brokers []string, group string, topics []string, o conformance.Options) (conformance.Runner, error) {
		return kafkagoconsumer.New(p, &kafkagoconsumer.Config{
			Reader: kafka.ReaderConfig{
				Brokers:           brokers,
				GroupID:           group,
				GroupTopics:       topics,
				MaxWait:           200 * time.Millisecond,
				SessionTimeout:    4 * time.Second, // 1.5 s: a loaded -race CI run missed heartbeats
				RebalanceTimeout:  2 * time.Second,
				HeartbeatInterval: 150 * time.Millisecond,
				JoinGroupBackoff:  100 * time.Millisecond,
				ReadBackoffMin:    20 * time.Millisecond,
				ReadBackoffMax:    200 * time.Millisecond,
			},
			CommitInterval: 200 * time.Millisecond,

			StopOnMissingDeadLetterTopic: o.StopOnMissingDeadLetterTopic,
			Logger:                       o.Logger,
		})
	},
}

func TestMain(m *testing.M) {
	conformance.MaybeChild(adapter)
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
		// pgconn's background reader of a connection of the shared test
		// pool, which outlives the tests by design.
		goleak.IgnoreAnyFunction("github.com/jackc/pgx/v5/pgconn/internal/bgreader.(*BGReader).bgRead"),
	)
	os.Exit(0)
}

func TestConformance(t *testing.T) {
	conformance.Run(t, adapter)
}
