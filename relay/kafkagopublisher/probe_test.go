package kafkagopublisher_test

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
)

// TestUnknownTopicProbeDoesNotDialPerPublish: a topic that does not exist
// yet (the common unknown topic: created after its producers were
// deployed) fails every Publish call that carries one of its records, for
// UnknownTopicGrace (a minute by default). Each such call now dials, and
// handshakes (TLS, SASL), a connection of its own for the by-name probe,
// and holds the call (the relay's round) until it answered. With a steady
// stream of events to the topic, that is a new authenticated connection
// per round. A probe answer per topic reused for a while (or a long-lived
// probe transport) would bound it.
func TestUnknownTopicProbeDoesNotDialPerPublish(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "present"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var dials atomic.Int64
	tr := &kafka.Transport{Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}}
	defer tr.CloseIdleConnections()
	p, err := kafkagopublisher.New(c.ListenAddrs(), &kafkagopublisher.Config{Transport: tr, MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Warm up the shared transport's connections.
	if err := p.Publish(ctx, []relay.Record{{Topic: "present", Key: []byte("k"), Value: []byte("v")}})[0]; err != nil {
		t.Fatal(err)
	}
	warm := dials.Load()
	const calls = 50
	start := time.Now()
	for i := 0; i < calls; i++ {
		errs := p.Publish(ctx, []relay.Record{
			{Topic: "present", Key: []byte("k"), Value: []byte("v")},
			{Topic: "not-created-yet", Key: []byte{byte(i)}, Value: []byte("v")},
		})
		if errs[0] != nil || !errors.Is(errs[1], relay.ErrUnknownTopic) {
			t.Fatalf("call %d: %v", i, errs)
		}
	}
	n := dials.Load() - warm
	t.Logf("%d Publish calls with a record of a missing topic in %s: %d new connections", calls, time.Since(start).Round(time.Millisecond), n)
	if n > 5 {
		t.Errorf("%d Publish calls with a record of a missing topic dialed %d new connections (one probe connection per call)", calls, n)
	}
}

// TestHiddenTopicStaysForbiddenWhenAnotherTopicUsesUpTheCall: the probe
// runs on what is left of the Publish call's ctx, after every topic's
// writes. When a later topic's partition does not answer before ctx ends
// (a sick partition: the relay's PublishTimeout), the probe cannot run and
// the hidden topic's records are reported unknown in that call, forbidden
// in the next. The relay restarts an event's refusal run when its kind
// changes (store.go: first_refused_at = now() unless refused_kind is the
// same), so a hidden topic alternating between the two is dead-lettered
// after neither grace.
func TestHiddenTopicStaysForbiddenWhenAnotherTopicUsesUpTheCall(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "hidden", "slow"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	h := c.Fault(kfake.Fault{Topic: "hidden", Err: kerr.TopicAuthorizationFailed, Count: -1})
	defer h.Remove()
	release := make(chan struct{})
	defer close(release)
	c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		for _, tp := range req.(*kmsg.ProduceRequest).Topics {
			if tp.Topic == "slow" {
				c.SleepControl(func() {
					select {
					case <-release:
					case <-time.After(3 * time.Second):
					}
				})
			}
		}
		return nil, nil, false
	})
	p, err := kafkagopublisher.New(c.ListenAddrs(), &kafkagopublisher.Config{MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	rec := []relay.Record{
		{Topic: "hidden", Key: []byte("a"), Value: []byte("v")},
		{Topic: "slow", Key: []byte("b"), Value: []byte("v")},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	if err := p.Publish(ctx, rec[:1])[0]; !errors.Is(err, relay.ErrTopicForbidden) {
		t.Fatalf("hidden topic alone: %v, want ErrTopicForbidden", err)
	}
	cancel()
	ctx, cancel = context.WithTimeout(context.Background(), time.Second) // the relay's PublishTimeout
	defer cancel()
	errs := p.Publish(ctx, rec)
	t.Logf("with a slow partition in the call: hidden: %v; slow: %v", errs[0], errs[1])
	if !errors.Is(errs[0], relay.ErrTopicForbidden) {
		t.Errorf("hidden topic beside a partition that outlasts the call: %v, want ErrTopicForbidden (as in the previous call)", errs[0])
	}
}

// TestUnknownTopicProbeIsBoundedWhenAuthenticationStalls: the brokers
// accept new connections but their SASL authentication stalls (an LDAP or
// OAuth back end that hangs), while the publisher's connections, already
// authenticated, keep working. kafka-go bounds a new connection's dial,
// TLS and ApiVersions by DialTimeout, but clears the deadline before SASL
// (transport.go connect: pc.SetDeadline(time.Time{}) then
// authenticateSASL), so the probe's connection waits for as long as the
// caller's ctx: every Publish call (relay round) with a record of a
// missing topic is held for the whole PublishTimeout, although its writes
// were answered at once. In kafkagoconsumer the dead-letter publish ctx
// has no deadline, so the partition waits until shutdown without a log or
// a failure hook.
func TestUnknownTopicProbeIsBoundedWhenAuthenticationStalls(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.EnableSASL(),
		kfake.Superuser("PLAIN", "u", "p"), kfake.SeedTopics(1, "present"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var stall atomic.Bool
	release := make(chan struct{})
	defer close(release)
	c.ControlKey(int16(kmsg.SASLAuthenticate), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if stall.Load() {
			c.SleepControl(func() { <-release })
		}
		return nil, nil, false
	})
	tr := &kafka.Transport{SASL: plainMechanism{"u", "p"}}
	defer tr.CloseIdleConnections()
	p, err := kafkagopublisher.New(c.ListenAddrs(), &kafkagopublisher.Config{Transport: tr, MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ok := relay.Record{Topic: "present", Key: []byte("k"), Value: []byte("v")}
	// Generous for a loaded CI machine: 10 s shared by both calls ran out
	// in one run.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := p.Publish(ctx, []relay.Record{ok})[0]; err != nil {
		t.Fatal(err)
	}
	stall.Store(true)
	start := time.Now()
	ctx, cancel = context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := p.Publish(ctx, []relay.Record{ok})[0]; err != nil {
		t.Fatalf("publish on the authenticated connections: %v", err)
	}
	t.Logf("a call to an existing topic: %s", time.Since(start).Round(time.Millisecond))
	ctx2, cancel2 := context.WithTimeout(context.Background(), 20*time.Second) // as the relay's PublishTimeout (30s by default)
	defer cancel2()
	start = time.Now()
	errs := p.Publish(ctx2, []relay.Record{ok, {Topic: "not-created-yet", Key: []byte("m"), Value: []byte("v")}})
	took := time.Since(start)
	t.Logf("a call with a missing topic's record: %s: %v", took.Round(time.Millisecond), errs)
	if took > 8*time.Second {
		t.Errorf("a Publish call whose writes were answered at once was held %s (until its ctx ended) by the unknown-topic probe", took.Round(time.Second))
	}
}

type plainMechanism struct{ user, pass string }

func (plainMechanism) Name() string { return "PLAIN" }
func (m plainMechanism) Start(context.Context) (sasl.StateMachine, []byte, error) {
	return m, []byte("\x00" + m.user + "\x00" + m.pass), nil
}
func (plainMechanism) Next(context.Context, []byte) (bool, []byte, error) { return true, nil, nil }
