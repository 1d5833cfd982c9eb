package relay_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

// cutOffPublisher is a publisher whose way to Kafka an operator's network
// policy cuts and mends: while cut, Ping and every record fail, as for a
// broker that does not answer.
type cutOffPublisher struct {
	relay.Publisher
	cut atomic.Bool
}

var errCutOff = errors.New("dial tcp: i/o timeout (injected: no way to the brokers)")

func (p *cutOffPublisher) Publish(ctx context.Context, records []relay.Record) []error {
	if !p.cut.Load() {
		return p.Publisher.Publish(ctx, records)
	}
	errs := make([]error, len(records))
	for i := range errs {
		errs[i] = errCutOff
	}
	return errs
}

func (p *cutOffPublisher) Ping(ctx context.Context) error {
	if p.cut.Load() {
		return errCutOff
	}
	return p.Publisher.(interface{ Ping(context.Context) error }).Ping(ctx)
}

// Two relays run for failover. One of them loses its way to the brokers
// while it still reaches PostgreSQL (a network policy on its node, a
// certificate or SASL secret rotated under it, a zone cut off from the
// brokers). It kept renewing half the shards and their events waited for as
// long as its isolation lasted, while the other relay idled (cold review,
// helper 61). It leaves them to the relay that reaches Kafka (here it is
// cut off from its start, so it takes none; TestACutOffRelayTakesItsShareBack
// has one cut off while it holds shards).
func TestARelayCutOffFromKafkaHandsItsShardsToOneThatReachesIt(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 4)
	// The isolated relay: its brokers' address answers nothing.
	isolated, err := kgopublisher.New([]string{"127.0.0.1:1"}, &kgopublisher.Config{Opts: []kgo.Opt{
		kgo.RetryBackoffFn(func(int) time.Duration { return 50 * time.Millisecond }),
	}})
	if err != nil {
		t.Fatal(err)
	}
	cfg := relay.Config{PublishTimeout: 2 * time.Second, KafkaHandoff: time.Second}
	cfg.InstanceID = "isolated"
	iso, _ := b.startRelayWith(t, b.pool, isolated, cfg)
	cfg.InstanceID = "healthy"
	b.startRelayWith(t, b.pool, b.publisher(t), cfg)
	time.Sleep(2 * time.Second) // a few lease ticks: the shards are shared out

	msgs := make([]outbox.Message, 0, 1000)
	for i := range 1000 {
		msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint("k", i)), Value: []byte(fmt.Sprint(i))})
	}
	b.write(t, msgs...)
	written := time.Now()
	deadline := written.Add(60 * time.Second)
	for b.count(t, "outbox") > 0 && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
	}
	if n := b.count(t, "outbox"); n > 0 {
		t.Fatalf("%d of 1000 events still pending %s after they were written, though a relay that reaches Kafka runs: the relay that cannot reach it keeps %d shards (%d dead-lettered)",
			n, time.Since(written).Round(time.Second), len(iso.OwnedShards()), b.count(t, "outbox_dead"))
	}
	if n := b.count(t, "outbox_dead"); n != 0 {
		t.Fatalf("%d events dead-lettered", n)
	}
}

// When no relay reaches Kafka (the brokers are down), none hands its shards
// over: there is nobody to hand them to, and shards passed around would
// only churn. Each keeps its share, as before.
func TestRelaysAllCutOffFromKafkaKeepTheirShards(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var relays []*relay.Relay
	for _, id := range []string{"a", "b"} {
		pub := &cutOffPublisher{Publisher: b.publisher(t)}
		pub.cut.Store(true)
		r, _ := b.startRelayWith(t, b.pool, pub, relay.Config{InstanceID: id, PublishTimeout: time.Second, KafkaHandoff: time.Second})
		relays = append(relays, r)
	}
	owned := func() (n int) {
		for _, r := range relays {
			n += len(r.OwnedShards())
		}
		return n
	}
	waitFor(t, "the relays to share the shards", 30*time.Second, func() bool {
		return len(relays[0].OwnedShards()) > 0 && len(relays[1].OwnedShards()) > 0
	})
	time.Sleep(4 * time.Second) // many handoff periods and lease ticks
	if len(relays[0].OwnedShards()) == 0 || len(relays[1].OwnedShards()) == 0 || owned() != relay.NumShards {
		t.Fatalf("with no relay reaching Kafka: relays own %d and %d shards, want all %d shared",
			len(relays[0].OwnedShards()), len(relays[1].OwnedShards()), relay.NumShards)
	}
}

// A relay that handed its shards over takes its share back once it
// reaches Kafka again, and its events are published.
func TestACutOffRelayTakesItsShareBackWhenKafkaReturns(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 4)
	pub := &cutOffPublisher{Publisher: b.publisher(t)}
	cfg := relay.Config{PublishTimeout: time.Second, KafkaHandoff: time.Second}
	cfg.InstanceID = "flaky"
	flaky, _ := b.startRelayWith(t, b.pool, pub, cfg)
	cfg.InstanceID = "steady"
	steady, _ := b.startRelayWith(t, b.pool, b.publisher(t), cfg)
	waitFor(t, "both relays to hold shards", 30*time.Second, func() bool {
		return len(flaky.OwnedShards()) > 0 && len(steady.OwnedShards()) > 0
	})
	pub.cut.Store(true)
	waitFor(t, "the cut-off relay to hand every shard over", 30*time.Second, func() bool {
		return len(flaky.OwnedShards()) == 0 && len(steady.OwnedShards()) == relay.NumShards
	})
	pub.cut.Store(false)
	waitFor(t, "the relay to take its share back", 30*time.Second, func() bool {
		return len(flaky.OwnedShards()) > 0 && len(steady.OwnedShards()) < relay.NumShards
	})
	msgs := make([]outbox.Message, 0, 500)
	for i := range 500 {
		msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint("k", i)), Value: []byte(fmt.Sprint(i))})
	}
	b.write(t, msgs...)
	waitFor(t, "every event to be published", 60*time.Second, func() bool { return b.count(t, "outbox") == 0 })
}
