package kafkagopublisher_test

import (
	"testing"

	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
	"github.com/onceflow/onceflow/relay/relaytest"
)

func TestConformance(t *testing.T) {
	relaytest.RunPublisherConformance(t, func(t *testing.T, brokers []string) relay.Publisher {
		p, err := kafkagopublisher.New(brokers, nil)
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
