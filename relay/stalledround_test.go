package relay_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// stallAtMark holds every statement of one relay's pool from the first
// time, once armed, it marks a round in flight (INSERT INTO relay_rounds)
// until released: a database connection that stalls (a failover, a
// stalled process) between a round's read and its publish, its lease
// ticks stalled with it.
type stallAtMark struct {
	armed   atomic.Bool
	stalled chan struct{} // closed at the stall
	release chan struct{} // closed: statements pass again
	marked  chan struct{} // closed once the stalled mark is written
	once    sync.Once
	on      atomic.Bool
}

type stalledMarkKey struct{}

func newStallAtMark() *stallAtMark {
	return &stallAtMark{stalled: make(chan struct{}), release: make(chan struct{}), marked: make(chan struct{})}
}

// now stalls every statement from now on (until released).
func (s *stallAtMark) now() {
	s.once.Do(func() {
		s.on.Store(true)
		close(s.stalled)
		close(s.marked)
	})
}

func (s *stallAtMark) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if s.armed.Load() && strings.HasPrefix(d.SQL, "INSERT INTO") && strings.Contains(d.SQL, "relay_rounds") {
		s.once.Do(func() {
			s.on.Store(true)
			close(s.stalled)
			ctx = context.WithValue(ctx, stalledMarkKey{}, true)
		})
	}
	if s.on.Load() {
		<-s.release
	}
	return ctx
}

func (s *stallAtMark) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if ctx.Value(stalledMarkKey{}) != nil {
		close(s.marked)
	}
}

// settlingPublisher acknowledges every record, in order per key, but the
// values it refuses as too large (while refuse holds them) and those it
// leaves unanswered until the call's deadline (once each, while hang holds
// them). It notes the values it wrote, in order.
type settlingPublisher struct {
	mu      sync.Mutex
	refuse  map[string]bool
	hang    map[string]bool
	hung    chan struct{} // closed when a value was left unanswered
	written []string
	refused int // records refused as too large
}

func (p *settlingPublisher) Publish(ctx context.Context, records []relay.Record) []error {
	p.mu.Lock()
	hang := false
	for _, r := range records {
		if p.hang[string(r.Value)] {
			delete(p.hang, string(r.Value))
			hang = true
		}
	}
	p.mu.Unlock()
	if hang {
		close(p.hung)
		<-ctx.Done()
		errs := make([]error, len(records))
		for i := range errs {
			errs[i] = ctx.Err()
		}
		return errs
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return publishLikeAPartition(records, func(r relay.Record) (error, bool) {
		if p.refuse[string(r.Value)] {
			p.refused++
			return relay.ErrRecordTooLarge, false
		}
		return nil, true
	}, func(v string) { p.written = append(p.written, v) })
}

func (p *settlingPublisher) setRefused(v string, refused bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refuse[v] = refused
}

func (p *settlingPublisher) refusedCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.refused
}

func (p *settlingPublisher) writtenValues() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.written...)
}

func (*settlingPublisher) Close() error { return nil }

// stallingPublisher is one relay's way to a settlingPublisher whose first
// call stalls that relay's statements and then hangs, with Kafka, until
// released or its context ends: a publish in flight while the relay's
// database stalls past its lease.
type stallingPublisher struct {
	*settlingPublisher
	stall    *stallAtMark
	release  chan struct{}
	returned chan struct{} // closed when the first call returned
	calls    atomic.Int32
}

func (p *stallingPublisher) Publish(ctx context.Context, records []relay.Record) []error {
	if p.calls.Add(1) != 1 {
		return p.settlingPublisher.Publish(ctx, records)
	}
	defer close(p.returned)
	p.stall.now()
	select {
	case <-p.release:
	case <-ctx.Done():
	}
	if ctx.Err() != nil {
		errs := make([]error, len(records))
		for i := range errs {
			errs[i] = ctx.Err()
		}
		return errs
	}
	return p.settlingPublisher.Publish(ctx, records)
}

// A relay that read a round and stalled before publishing it, past its
// lease, must not publish it once it resumes: meanwhile another relay took
// the shard and settled the round's events. Here the new owner
// dead-letters the key's first event (the topic refuses it as too large)
// and publishes the second; then the topic's limit is raised. Published by
// the stalled relay, the first event would go out after the second (G3),
// and be both dead-lettered and published. Both ways a round reaches
// Kafka: a round read by the rounds, and a retry beside them of an event
// that was not acknowledged in time; and a round already with Kafka when
// the statements stall, its publish cut short once the lease is lost.
func TestAStalledRelayDoesNotPublishWhatItsSuccessorSettled(t *testing.T) {
	t.Parallel()
	for _, path := range []string{"round", "side retry", "in flight"} {
		t.Run(path, func(t *testing.T) {
			t.Parallel()
			stalledRelayDoesNotPublish(t, path)
		})
	}
}

func stalledRelayDoesNotPublish(t *testing.T, path string) {
	b := setup(t)
	b.write(t,
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("first")},
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("second")},
	)
	pub := &settlingPublisher{refuse: map[string]bool{"first": true}, hang: map[string]bool{}, hung: make(chan struct{})}
	stall := newStallAtMark()
	var stalledPub relay.Publisher = pub
	var inFlight *stallingPublisher
	cfg := relay.Config{InstanceID: "stalled", LeaseDuration: 600 * time.Millisecond, PublishTimeout: 200 * time.Millisecond,
		MaxRetryBackoff: 50 * time.Millisecond}
	switch path {
	case "in flight":
		inFlight = &stallingPublisher{settlingPublisher: pub, stall: stall, release: make(chan struct{}), returned: make(chan struct{})}
		stalledPub = inFlight
		cfg.PublishTimeout = 30 * time.Second // not what ends it
	case "side retry":
		// The stalled relay's first try of the round times out; the
		// stall comes at its retry beside the rounds.
		pub.hang["first"] = true
		go func() {
			<-pub.hung
			stall.armed.Store(true)
		}()
	default:
		stall.armed.Store(true)
	}
	_, stopStalled := b.startRelayWith(t, pgtest.TracedPool(t, stall, 4), stalledPub, cfg)
	waitFor(t, "the stall", 30*time.Second, closed(stall.stalled))

	cfg.InstanceID, cfg.PublishTimeout = "successor", 200*time.Millisecond
	_, stopSuccessor := b.startRelayWith(t, b.pool, pub, cfg)
	waitFor(t, "the successor to settle both events", 30*time.Second, func() bool {
		return b.count(t, "outbox") == 0 && b.count(t, "outbox_dead") == 1
	})
	stopSuccessor()

	pub.setRefused("first", false) // the topic's limit raised
	if inFlight != nil {
		close(inFlight.release)
		<-inFlight.returned
	}
	close(stall.release)
	b.waitRoundLetGo(t, "the stalled relay to let its round go", stall.marked, "stalled")
	stopStalled()

	wantOnlySecondWritten(t, pub, "the successor dead-lettered the first event and published the second")
}

// closed reports, as a waitFor condition, whether c is closed.
func closed(c <-chan struct{}) func() bool {
	return func() bool {
		select {
		case <-c:
			return true
		default:
			return false
		}
	}
}

// waitRoundLetGo waits, once marked is closed (the relay's stalled
// statement has run), until the relay under instance has no round in
// flight left: it published it, or let it go.
func (b *bundle) waitRoundLetGo(t *testing.T, what string, marked <-chan struct{}, instance string) {
	t.Helper()
	rounds := pgx.Identifier{b.schema, "relay_rounds"}.Sanitize()
	waitFor(t, what, 30*time.Second, func() bool {
		if !closed(marked)() {
			return false
		}
		var n int
		if err := b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+rounds+` WHERE instance = $1`, instance).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
}

// wantOnlySecondWritten fails the test unless "second" is the only value
// pub first published: "first" was dead-lettered (by a successor, after
// what) before "second" went out, so publishing it now breaks G3 and G7.
func wantOnlySecondWritten(t *testing.T, pub *settlingPublisher, after string) {
	t.Helper()
	if got := firstPublications(pub.writtenValues()); len(got) != 1 || got[0] != "second" {
		t.Fatalf("written %v after %s: want [second] only (G3, G7)", got, after)
	}
}
