package relay_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// failKeyPublisher fails every record of key for its first fails calls
// that carry the key (with a passing error), acknowledges the rest, and
// records how many of the key's records each call carried and the order of
// the key's acknowledged values.
type failKeyPublisher struct {
	key   string
	fails int

	mu     sync.Mutex
	calls  []int // records of key per call that carried any
	acked  []string
	others int
}

func (p *failKeyPublisher) Publish(_ context.Context, records []relay.Record) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, r := range records {
		if string(r.Key) == p.key {
			n++
		}
	}
	fail := n > 0 && len(p.calls) < p.fails
	if n > 0 {
		p.calls = append(p.calls, n)
	}
	errs := make([]error, len(records))
	for i, r := range records {
		switch {
		case string(r.Key) != p.key:
			p.others++
		case fail:
			errs[i] = errors.New("NOT_ENOUGH_REPLICAS (injected)")
		default:
			p.acked = append(p.acked, string(r.Value))
		}
	}
	return errs
}

func (p *failKeyPublisher) Close() error { return nil }

// A key whose event failed is retried with that event alone, not with a
// round of its later events behind it (a key stuck with 300,000 events
// would fill every retry round and charge each held-back event an
// attempt); once it is acknowledged, the later events follow in order.
func TestRetryOfAFailedKeySendsItsFailedEventAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var msgs []outbox.Message
	for i := range 20 {
		msgs = append(msgs, outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte(fmt.Sprint(i))})
	}
	for i := range 10 {
		msgs = append(msgs, outbox.Message{Topic: "t", Key: []byte(fmt.Sprintf("other-%d", i)), Value: []byte("v")})
	}
	b.write(t, msgs...)
	pub := &failKeyPublisher{key: "K", fails: 4}
	r, err := relay.New(b.pool, pub, &relay.Config{Schema: b.schema, BatchSize: 10, PollInterval: 20 * time.Millisecond, LeaseDuration: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	waitFor(t, "the outbox to drain", 60*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	pub.mu.Lock()
	defer pub.mu.Unlock()
	t.Logf("records of K per call: %v", pub.calls)
	if len(pub.calls) < pub.fails+1 {
		t.Fatalf("calls carrying K: %v, want at least %d", pub.calls, pub.fails+1)
	}
	for i, n := range pub.calls[1 : pub.fails+1] {
		if n != 1 {
			t.Errorf("retry %d carried %d events of K, want its failed event alone", i+1, n)
		}
	}
	want := make([]string, 20)
	for i := range want {
		want[i] = fmt.Sprint(i)
	}
	// In the order of first acknowledgements (a re-send may repeat earlier
	// events: G3).
	var first []string
	for _, v := range pub.acked {
		if !slices.Contains(first, v) {
			first = append(first, v)
		}
	}
	if !slices.Equal(first, want) {
		t.Errorf("K first acknowledged in the order %v, want %v", pub.acked, want)
	}
	if pub.others < 10 {
		t.Errorf("other keys published %d times, want 10", pub.others)
	}
}

// A round in which one key failed and everything else was its own later
// events, held back behind the failure, says nothing about the broker: the
// key waits out its own backoff, and the other keys are read at once. The
// relay used to take such a round for an outage ("everything failed") and
// pause every key for the round backoff; a key stuck with a backlog did so
// on its first round and again whenever its hold was lost.
func TestOneKeyFailingAWholeRoundDoesNotPauseTheOtherKeys(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var msgs []outbox.Message
	for i := range 30 {
		msgs = append(msgs, outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte(fmt.Sprint(i))})
	}
	for i := range 20 {
		msgs = append(msgs, outbox.Message{Topic: "t", Key: []byte(fmt.Sprintf("other-%d", i)), Value: []byte("v")})
	}
	b.write(t, msgs...)
	pub := &failKeyPublisher{key: "K", fails: 1 << 30}
	logger, logs := newLogger(slog.LevelDebug)
	b.startRelayWith(t, b.pool, pub, relay.Config{BatchSize: 10, LeaseDuration: 10 * time.Second, Logger: logger})
	waitFor(t, "the other keys to drain", 60*time.Second, func() bool { return b.count(t, "outbox") == 30 })
	if paused := logs.lines(`msg="relay: round".* next=backoff`); len(paused) > 0 {
		t.Errorf("one key's failure paused the other keys:\n%s", strings.Join(paused, "\n"))
	}
}
