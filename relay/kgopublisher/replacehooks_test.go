package kgopublisher_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

// promHook does what franz-go's plugin/kprom does (kprom.NewMetrics, used
// as kgo.WithHooks(m), its documented use): OnNewClient registers the
// client's collectors with promauto.With(reg) (MustRegister), and
// OnClientClosed unregisters them.
type promHook struct {
	reg     *prometheus.Registry
	cs      []prometheus.Collector
	clients atomic.Int64
}

func (h *promHook) OnNewClient(cl *kgo.Client) {
	defer h.clients.Add(1)
	f := promauto.With(h.reg)
	c := f.NewCounterVec(prometheus.CounterOpts{Namespace: "relay", Name: "connects_total", Help: "connections"}, []string{"node_id"})
	g := f.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "relay", Name: "buffered_produce_records_total", Help: "buffered"},
		func() float64 { return float64(cl.BufferedProduceRecords()) })
	h.cs = append(h.cs, c, g)
}

func (h *promHook) OnClientClosed(*kgo.Client) {
	for _, c := range h.cs {
		h.reg.Unregister(c)
	}
}

// The publisher rebuilds its client from the stored options when
// the brokers refuse it a producer id. Options are not all reusable: a
// metrics hook such as kprom registers its collectors on each new client,
// and the new client is built while the refused one still holds them. The
// relay's Publish then panics (the whole relay process dies) on the first
// CLUSTER_AUTHORIZATION_FAILED, where before it retried (cold review, helper 65).
func TestReplacedClientReusesPerClientHook(t *testing.T) {
	k := kafkatest.New(t)
	fake := k.RequireFake(t)
	topic := k.Topic(t, 1)
	fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.InitProducerID}, Err: kerr.ClusterAuthorizationFailed, TopLevel: true, Count: -1})

	h := &promHook{reg: prometheus.NewRegistry()}
	p, err := kgopublisher.New(k.Brokers, &kgopublisher.Config{Opts: []kgo.Opt{kgo.WithHooks(h)}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })

	publish := func() (errs []error, panicked any) {
		defer func() { panicked = recover() }()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return p.Publish(ctx, []relay.Record{{Topic: topic, Key: []byte("k"), Value: []byte("v")}}), nil
	}
	// Until a record fails with the refusal (a loaded machine may time a
	// call out first).
	var errs []error
	for deadline := time.Now().Add(30 * time.Second); ; {
		var panicked any
		errs, panicked = publish()
		if panicked != nil {
			t.Fatalf("Publish panicked on a refused producer id (a relay process would crash): %v", panicked)
		}
		if errs[0] == nil {
			t.Fatal("published although the producer id was refused")
		}
		if errors.Is(errs[0], kerr.ClusterAuthorizationFailed) || time.Now().After(deadline) {
			break
		}
	}
	t.Logf("first refused publish: %v", errs[0])
	// The replacement runs beside Publish: a panic there ends the test
	// binary. Wait for the successor to be built.
	deadline := time.Now().Add(10 * time.Second)
	for h.clients.Load() < 2 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := h.clients.Load(); n < 2 {
		t.Fatalf("%d clients built in 10 s; want the refused one replaced", n)
	}
}
