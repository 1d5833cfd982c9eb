package main

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/relay"
)

// gatedPublisher holds each Publish until its gate (by the first record's
// topic) is closed.
type gatedPublisher struct {
	mu    sync.Mutex
	gates map[string]chan struct{}
}

func (p *gatedPublisher) gate(topic string) chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.gates[topic] == nil {
		p.gates[topic] = make(chan struct{})
	}
	return p.gates[topic]
}

func (p *gatedPublisher) Publish(ctx context.Context, records []relay.Record) []error {
	<-p.gate(records[0].Topic)
	return make([]error, len(records))
}

func (p *gatedPublisher) Close() error { return nil }

// A side retry runs beside the rounds, so two publishes can be in flight.
// The one that ends first must not hide the other: the waiting gauge read
// 0 while a round still waited for Kafka, so the stuck-round warning never
// came, and /livez could fail a relay waiting on purpose.
func TestPublishWaitingCountsTheOldestPublishInFlight(t *testing.T) {
	pub := &gatedPublisher{gates: map[string]chan struct{}{}}
	reg := prometheus.NewRegistry()
	w := newBrokerWatch(pub, slog.New(slog.NewTextHandler(io.Discard, nil)), reg, time.Second)
	gauge := func() float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "onceflow_relay_publish_waiting_seconds" {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		t.Fatal("onceflow_relay_publish_waiting_seconds not registered")
		return 0
	}

	var done sync.WaitGroup
	publish := func(topic string) {
		done.Add(1)
		go func() {
			defer done.Done()
			w.Publish(context.Background(), []relay.Record{{Topic: topic}})
		}()
	}
	publish("round")
	time.Sleep(50 * time.Millisecond)
	publish("side-retry")
	time.Sleep(50 * time.Millisecond)
	close(pub.gate("side-retry"))
	time.Sleep(50 * time.Millisecond)

	if d := w.waiting(); d < 100*time.Millisecond {
		t.Fatalf("waiting %s with the round still in flight for at least 150ms", d)
	}
	if g := gauge(); g < 0.1 {
		t.Fatalf("onceflow_relay_publish_waiting_seconds %g with the round still in flight", g)
	}
	close(pub.gate("round"))
	done.Wait()
	if d := w.waiting(); d != 0 {
		t.Fatalf("waiting %s with nothing in flight", d)
	}
}
