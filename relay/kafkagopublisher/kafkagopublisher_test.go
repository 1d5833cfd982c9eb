package kafkagopublisher_test

import (
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
	"github.com/onceflow/onceflow/relay/relaytest"
)

func TestConformance(t *testing.T) {
	relaytest.RunPublisherConformance(t, func(t *testing.T, brokers []string) relay.Publisher {
		// A transport of its own: kafka.DefaultTransport caches metadata per
		// broker address for 6 s, so on a real broker (one address for all
		// subtests) a topic created after another subtest's first write
		// would be unknown to this publisher until that cache expires.
		tr := &kafka.Transport{}
		t.Cleanup(tr.CloseIdleConnections)
		p, err := kafkagopublisher.New(brokers, &kafkagopublisher.Config{Transport: tr})
		if err != nil {
			t.Fatal(err)
		}
		return p
	})
}

func TestNewRejectsBadConfig(t *testing.T) {
	if _, err := kafkagopublisher.New(nil, nil); err == nil {
		t.Error("New accepted no brokers")
	}
	if _, err := kafkagopublisher.New([]string{"127.0.0.1:1"}, &kafkagopublisher.Config{BatchBytes: 10}); err == nil {
		t.Error("New accepted BatchBytes 10")
	}
}
