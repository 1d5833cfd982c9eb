package relay_test

import (
	"context"
	"fmt"
	"github.com/jackc/pgx/v5"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// gatedPublisher holds each Publish until release is closed (or its
// context ends: then every record fails with the context's error), and
// reports on inFlight when one is waiting.
type gatedPublisher struct {
	relay.Publisher
	inFlight chan struct{}
	release  chan struct{}
	once     sync.Once
}

func (p *gatedPublisher) Publish(ctx context.Context, records []relay.Record) []error {
	p.once.Do(func() { close(p.inFlight) })
	select {
	case <-p.release:
		return p.Publisher.Publish(ctx, records)
	case <-ctx.Done():
		return failAll(len(records), ctx.Err())
	}
}

// gate returns a gatedPublisher in front of pub.
func gate(pub relay.Publisher) *gatedPublisher {
	return &gatedPublisher{Publisher: pub, inFlight: make(chan struct{}), release: make(chan struct{})}
}

// writeOverFiveKeys writes n events of topic, keys k0 to k4 in turn, each
// its index as value, and returns them.
func (b *bundle) writeOverFiveKeys(t *testing.T, topic string, n int) []outbox.Message {
	t.Helper()
	var msgs []outbox.Message
	for i := range n {
		msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint("k", i%5)), Value: []byte(fmt.Sprint(i))})
	}
	b.write(t, msgs...)
	return msgs
}

// failAll fails each of n records with err.
func failAll(n int, err error) []error {
	errs := make([]error, n)
	for i := range errs {
		errs[i] = err
	}
	return errs
}

// A relay stopped (SIGTERM in the binary) while its round is with Kafka
// waits a little for the acknowledgements and records them, so a rolling
// restart publishes nothing twice. The stop used to cancel the round's
// publish at once: its events stayed pending and the next relay published
// them again, a round of duplicates per stopped relay.
func TestAStoppedRelayRecordsTheRoundInFlight(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 4)
	msgs := b.writeOverFiveKeys(t, topic, 20)
	pub := gate(b.publisher(t))
	_, stop := b.startRelayWith(t, b.pool, pub, relay.Config{})
	select {
	case <-pub.inFlight:
	case <-time.After(30 * time.Second):
		t.Fatal("the relay published nothing")
	}
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	time.Sleep(200 * time.Millisecond) // the stop is under way
	close(pub.release)                 // Kafka acknowledges
	<-stopped
	if n := b.count(t, "outbox"); n != 0 {
		t.Fatalf("%d of the round's 20 events left pending after a stop: they would be published again", n)
	}
	seen := map[string]int{}
	for _, r := range b.kafka.ReadAll(t, topic, len(msgs), 30*time.Second) {
		seen[messageID(r)]++
	}
	if len(seen) != len(msgs) {
		t.Fatalf("%d distinct events in Kafka, want %d", len(seen), len(msgs))
	}
}

// sidePublisher lets its first Publish time out, then holds the next one
// (the side retry of the key that timed out) until release is closed or
// its context ends, reporting on inFlight when it waits.
type sidePublisher struct {
	relay.Publisher
	calls    int
	mu       sync.Mutex
	inFlight chan struct{}
	release  chan struct{}
}

func (p *sidePublisher) Publish(ctx context.Context, records []relay.Record) []error {
	p.mu.Lock()
	p.calls++
	call := p.calls
	p.mu.Unlock()
	fail := func() []error { return failAll(len(records), ctx.Err()) }
	switch call {
	case 1: // Kafka does not answer: the publish timeout
		<-ctx.Done()
		return fail()
	case 2: // the side retry
		close(p.inFlight)
		select {
		case <-p.release:
		case <-ctx.Done():
			return fail()
		}
	}
	return p.Publisher.Publish(ctx, records)
}

// A relay stopped while the side retry of a key that timed out is with
// Kafka gives it the same grace as a round: the retry used its run's
// context and was cut at once, so its event stayed pending and the next
// relay published it again.
func TestAStoppedRelayRecordsTheSideRetryInFlight(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 1)
	b.write(t, outbox.Message{Topic: topic, Key: []byte("slow"), Value: []byte("v")})
	pub := &sidePublisher{Publisher: b.publisher(t), inFlight: make(chan struct{}), release: make(chan struct{})}
	_, stop := b.startRelayWith(t, b.pool, pub, relay.Config{PublishTimeout: 300 * time.Millisecond, MaxRetryBackoff: 100 * time.Millisecond})
	select {
	case <-pub.inFlight:
	case <-time.After(30 * time.Second):
		t.Fatal("the key that timed out was not retried")
	}
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	time.Sleep(200 * time.Millisecond) // the stop is under way
	close(pub.release)                 // Kafka acknowledges the retry
	<-stopped
	if n := b.count(t, "outbox"); n != 0 {
		t.Fatalf("the retried event is still pending after a stop: it would be published again")
	}
	if got := b.kafka.ReadAll(t, topic, 1, 30*time.Second); len(got) != 1 {
		t.Fatalf("%d records in Kafka, want the event once", len(got))
	}
}

// refusingSidePublisher lets its first Publish time out, then refuses every
// record with a broker error until release is closed.
type refusingSidePublisher struct {
	relay.Publisher
	mu      sync.Mutex
	calls   int
	release chan struct{}
}

func (p *refusingSidePublisher) Publish(ctx context.Context, records []relay.Record) []error {
	p.mu.Lock()
	p.calls++
	call := p.calls
	p.mu.Unlock()
	if call == 1 {
		<-ctx.Done()
		return failAll(len(records), ctx.Err())
	}
	select {
	case <-p.release:
		return p.Publisher.Publish(ctx, records)
	default:
	}
	return failAll(len(records), errNotEnoughReplicas)
}

// A side retry that Kafka refuses (not one it leaves unanswered) is
// recorded as that refusal: its outcome was judged after its publish
// context had been released, so every failure of a side retry counted as
// a timeout ("not acknowledged within the publish timeout" in last_error,
// BatchStats.TimedOut).
func TestASideRetryRefusedIsNotRecordedAsATimeout(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 1)
	b.write(t, outbox.Message{Topic: topic, Key: []byte("slow"), Value: []byte("v")})
	pub := &refusingSidePublisher{Publisher: b.publisher(t), release: make(chan struct{})}
	_, stop := b.startRelayWith(t, b.pool, pub, relay.Config{PublishTimeout: 300 * time.Millisecond, MaxRetryBackoff: 100 * time.Millisecond})
	defer stop()
	table := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	lastError := func() string {
		var e *string
		if err := b.pool.QueryRow(context.Background(), `SELECT last_error FROM `+table).Scan(&e); err != nil || e == nil {
			return ""
		}
		return *e
	}
	waitFor(t, "the side retry's refusal to be recorded", 30*time.Second, func() bool {
		pub.mu.Lock()
		calls := pub.calls
		pub.mu.Unlock()
		return calls >= 3 && lastError() != ""
	})
	if got := lastError(); got != errNotEnoughReplicas.Error() {
		t.Fatalf("last_error after the side retry was refused: %q, want %q", got, errNotEnoughReplicas.Error())
	}
	close(pub.release)
	waitFor(t, "the event to be published", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
}
