package kafkagopublisher_test

import (
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
)

// Close after a Publish its context abandoned, against a broker that does
// not answer, returns within its bound: kafka-go's Writer.Close waits for
// every write still in flight, here 51 s (5 attempts of 10 s each), and
// the relay binary closes its publisher on the way out of a SIGTERM, past
// an orchestrator's grace.
func TestCloseDoesNotWaitOutWritesABrokerDoesNotAnswer(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	release := make(chan struct{})
	defer close(release) // the writes still in flight end with the test
	c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		c.SleepControl(func() { <-release })
		return nil, nil, false
	})
	p, err := kafkagopublisher.New(c.ListenAddrs(), &kafkagopublisher.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := p.Publish(ctx, []relay.Record{{Topic: "t", Key: []byte("k"), Value: []byte("v")}})[0]; err == nil {
		t.Fatal("a record the broker never acknowledged was published")
	}
	start := time.Now()
	_ = p.Close()
	if took := time.Since(start); took > 8*time.Second {
		t.Fatalf("Close took %s, want about 5 s at most", took.Round(time.Millisecond))
	}
}
