package kgoconsumer

import (
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer/internal/deadletter"
)

func TestDeadLetterBatchMax(t *testing.T) {
	for _, tc := range []struct {
		name string
		user []kgo.Opt
		want int32
	}{
		{"none", nil, deadletter.MaxBytes},
		{"write limit above", []kgo.Opt{kgo.BrokerMaxWriteBytes(200 << 20)}, deadletter.MaxBytes},
		{"write limit below", []kgo.Opt{kgo.BrokerMaxWriteBytes(32 << 20)}, 32 << 20},
		{"odd write limit below", []kgo.Opt{kgo.BrokerMaxWriteBytes(5_000_003)}, 5_000_003},
		// The user's batch limit, after the adapter's, wins.
		{"own batch limit", []kgo.Opt{kgo.BrokerMaxWriteBytes(32 << 20), kgo.ProducerBatchMaxBytes(16 << 20)}, deadletter.MaxBytes},
		// Left for kgo.NewClient to report.
		{"invalid", []kgo.Opt{kgo.BrokerMaxWriteBytes(10)}, deadletter.MaxBytes},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := append([]kgo.Opt{kgo.SeedBrokers("localhost:9092"), nil}, tc.user...)
			got := deadLetterBatchMax(opts, 1)
			if got != tc.want {
				t.Fatalf("got %d, want %d", got, tc.want)
			}
			opts[1] = kgo.ProducerBatchMaxBytes(got)
			if err := kgo.ValidateOpts(opts...); err != nil && tc.name != "invalid" {
				t.Fatalf("with the limit found: %v", err)
			}
		})
	}
}
