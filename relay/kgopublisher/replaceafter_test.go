package kgopublisher_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

type lifeHook struct{ created, closed atomic.Int64 }

func (h *lifeHook) OnNewClient(*kgo.Client)    { h.created.Add(1) }
func (h *lifeHook) OnClientClosed(*kgo.Client) { h.closed.Add(1) }

// Ping, Partition, Publish after replacements; Close closes
// every client; concurrent Publish calls during replacements.
func TestPublisherAfterReplacements(t *testing.T) {
	k := kafkatest.New(t)
	fake := k.RequireFake(t)
	topic := k.Topic(t, 3)
	denied := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.InitProducerID}, Err: kerr.ClusterAuthorizationFailed, TopLevel: true, Count: -1})
	h := &lifeHook{}
	p, err := kgopublisher.New(k.Brokers, &kgopublisher.Config{Opts: []kgo.Opt{kgo.WithHooks(h)}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	recs := []relay.Record{{Topic: topic, Key: []byte("a"), Value: []byte("1")}, {Topic: topic, Key: []byte("b"), Value: []byte("2")}}
	deadline := time.Now().Add(3500 * time.Millisecond)
	done := make(chan struct{})
	go func() { // the retry goroutine
		defer close(done)
		for time.Now().Before(deadline) {
			p.Publish(ctx, recs[1:])
			time.Sleep(7 * time.Millisecond)
		}
	}()
	for time.Now().Before(deadline) {
		p.Publish(ctx, recs[:1])
		time.Sleep(5 * time.Millisecond)
	}
	<-done
	t.Logf("clients created while refused: %d", h.created.Load())
	denied.Remove()
	time.Sleep(1100 * time.Millisecond)
	p.Publish(ctx, recs) // refused once more at most: replaced
	var errs []error
	for i := 0; i < 50; i++ {
		if errs = p.Publish(ctx, recs); errs[0] == nil && errs[1] == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if errs[0] != nil || errs[1] != nil {
		t.Fatalf("not published after the grant: %v", errs)
	}
	if err := p.Ping(ctx); err != nil {
		t.Errorf("Ping after replacement: %v", err)
	}
	if _, ok := p.Partition(topic, []byte("a")); !ok {
		t.Error("Partition after replacement: not ok")
	}
	_ = p.Close()
	_ = p.Close()
	time.Sleep(200 * time.Millisecond)
	if c, cl := h.created.Load(), h.closed.Load(); c != cl {
		t.Errorf("%d clients created, %d closed after Close", c, cl)
	}
	t.Logf("clients created in all: %d", h.created.Load())
}
