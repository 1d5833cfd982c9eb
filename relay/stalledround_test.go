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

func (p *settlingPublisher) writtenValues() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.written...)
}

func (*settlingPublisher) Close() error { return nil }

// A relay that read a round and stalled before publishing it, past its
// lease, must not publish it once it resumes: meanwhile another relay took
// the shard and settled the round's events. Here the new owner
// dead-letters the key's first event (the topic refuses it as too large)
// and publishes the second; then the topic's limit is raised. Published by
// the stalled relay, the first event would go out after the second (G3),
// and be both dead-lettered and published. Both ways a round reaches
// Kafka: a round read by the rounds, and a retry beside them of an event
// that was not acknowledged in time.
func TestAStalledRelayDoesNotPublishWhatItsSuccessorSettled(t *testing.T) {
	t.Parallel()
	for _, path := range []string{"round", "side retry"} {
		t.Run(path, func(t *testing.T) {
			t.Parallel()
			stalledRelayDoesNotPublish(t, path == "side retry")
		})
	}
}

func stalledRelayDoesNotPublish(t *testing.T, sideRetry bool) {
	b := setup(t)
	ctx := context.Background()
	b.write(t,
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("first")},
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("second")},
	)
	pub := &settlingPublisher{refuse: map[string]bool{"first": true}, hang: map[string]bool{}, hung: make(chan struct{})}
	stall := newStallAtMark()
	if sideRetry {
		// The stalled relay's first try of the round times out; the
		// stall comes at its retry beside the rounds.
		pub.hang["first"] = true
		go func() {
			<-pub.hung
			stall.armed.Store(true)
		}()
	} else {
		stall.armed.Store(true)
	}
	cfg := relay.Config{InstanceID: "stalled", LeaseDuration: 600 * time.Millisecond, PublishTimeout: 200 * time.Millisecond,
		MaxRetryBackoff: 50 * time.Millisecond}
	_, stopStalled := b.startRelayWith(t, pgtest.TracedPool(t, stall, 4), pub, cfg)
	waitFor(t, "the stall", 30*time.Second, func() bool {
		select {
		case <-stall.stalled:
			return true
		default:
			return false
		}
	})

	cfg.InstanceID = "successor"
	_, stopSuccessor := b.startRelayWith(t, b.pool, pub, cfg)
	waitFor(t, "the successor to settle both events", 30*time.Second, func() bool {
		return b.count(t, "outbox") == 0 && b.count(t, "outbox_dead") == 1
	})
	stopSuccessor()

	pub.setRefused("first", false) // the topic's limit raised
	close(stall.release)
	rounds := pgx.Identifier{b.schema, "relay_rounds"}.Sanitize()
	waitFor(t, "the stalled relay to let its round go", 30*time.Second, func() bool {
		select {
		case <-stall.marked:
		default:
			return false
		}
		var n int
		if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM `+rounds+` WHERE instance = 'stalled'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
	stopStalled()

	if got := firstPublications(pub.writtenValues()); len(got) != 1 || got[0] != "second" {
		t.Fatalf("written %v after the successor dead-lettered the first event and published the second: want [second] only (G3, G7)", got)
	}
}
