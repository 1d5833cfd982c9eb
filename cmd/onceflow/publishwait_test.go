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

	inFlight := func() int {
		w.inFlightMu.Lock()
		defer w.inFlightMu.Unlock()
		return len(w.inFlight)
	}
	waitFor := func(what string, ok func() bool) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for !ok() {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(time.Millisecond)
		}
	}
	var done sync.WaitGroup
	publish := func(topic string) {
		done.Add(1)
		go func() {
			defer done.Done()
			w.Publish(context.Background(), []relay.Record{{Topic: topic}})
		}()
	}
	roundSent := time.Now()
	publish("round")
	waitFor("the round in flight", func() bool { return inFlight() == 1 })
	publish("side-retry")
	waitFor("the side retry in flight beside it", func() bool { return inFlight() == 2 })
	close(pub.gate("side-retry"))
	waitFor("the side retry to end", func() bool { return inFlight() == 1 })

	// The round began after roundSent and still waits: the gauge is its
	// wait, not 0 (the side retry's end had reset it).
	if d, most := w.waiting(), time.Since(roundSent); d <= 0 || d > most {
		t.Fatalf("waiting %s with the round in flight for at most %s", d, most)
	}
	if g := gauge(); g <= 0 {
		t.Fatalf("onceflow_relay_publish_waiting_seconds %g with the round still in flight", g)
	}
	close(pub.gate("round"))
	done.Wait()
	if d := w.waiting(); d != 0 {
		t.Fatalf("waiting %s with nothing in flight", d)
	}
}
