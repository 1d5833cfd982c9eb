package kgoconsumer_test

import (
	"os"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/goleak"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/internal/conformance"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
)

var adapter = conformance.Adapter{
	HidesAborted: true,
	Cooperative:  true,
	New: func(p *consumer.Processor, brokers []string, group string, topics []string, o conformance.Options) (conformance.Runner, error) {
		var balance []kgo.Opt
		if o.Eager {
			balance = append(balance, kgo.Balancers(kgo.RangeBalancer()))
		}
		return kgoconsumer.New(p, &kgoconsumer.Config{
			Brokers:        brokers,
			Topics:         topics,
			Group:          group,
			CommitInterval: 200 * time.Millisecond,

			StopOnMissingDeadLetterTopic: o.StopOnMissingDeadLetterTopic,
			Logger:                       o.Logger,
			ClientOpts: append([]kgo.Opt{
				kgo.MetadataMinAge(100 * time.Millisecond),
				// Partitions added to a topic are found at the next
				// metadata refresh: 5 min by default.
				kgo.MetadataMaxAge(2 * time.Second),
				kgo.SessionTimeout(1500 * time.Millisecond),
				kgo.RebalanceTimeout(2 * time.Second),
				kgo.HeartbeatInterval(150 * time.Millisecond),
				kgo.FetchMaxWait(200 * time.Millisecond),
			}, balance...),
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
		goleak.IgnoreAnyFunction("github.com/twmb/franz-go/pkg/kfake.(*Cluster).run"),
		// A control function kfake runs in a goroutine of its own, still
		// taking the cluster's lock as Close returns (seen once in CI).
		goleak.IgnoreAnyFunction("github.com/twmb/franz-go/pkg/kfake.(*Cluster).runControl.func1"),
	)
	os.Exit(0)
}

func TestConformance(t *testing.T) {
	conformance.Run(t, adapter)
}
