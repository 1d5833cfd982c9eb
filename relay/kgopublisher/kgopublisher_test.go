package kgopublisher_test

import (
	"testing"

	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
	"github.com/onceflow/onceflow/relay/relaytest"
)

func TestConformance(t *testing.T) {
	relaytest.RunPublisherConformance(t, func(t *testing.T, brokers []string) relay.Publisher {
		// The client's defaults, as the binary runs it (a short
		// MetadataMinAge hid an unknown topic's cost).
		p, err := kgopublisher.New(brokers, nil)
		if err != nil {
			t.Fatal(err)
		}
		return p
	})
}

func TestNewRejectsBadConfig(t *testing.T) {
	if _, err := kgopublisher.New(nil, nil); err == nil {
		t.Error("New accepted no brokers")
	}
	if _, err := kgopublisher.New([]string{"127.0.0.1:1"}, &kgopublisher.Config{Linger: -1}); err == nil {
		t.Error("New accepted a negative linger")
	}
}
