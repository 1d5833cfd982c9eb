package relay_test

import (
	"context"
	"slices"
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

// stallAtBatch holds every statement of one relay's pool from the first
// batch, once armed, whose statements include match, until released: a
// relay whose database connection stalls (a failover, a frozen process)
// just as it records a round's outcome, its lease ticks stalled with it.
type stallAtBatch struct {
	match   string
	armed   atomic.Bool
	on      atomic.Bool
	once    sync.Once
	stalled chan struct{} // closed at the stall
	release chan struct{} // closed: statements pass again
	ended   chan struct{} // closed once the stalled batch has run
	// queries: match single statements too (not only batches).
	queries bool
	// rest, if not nil, holds the statements other than the stalled one
	// after release, until closed: the stalled one was on its way to the
	// server already (a frozen process's last write), the others not.
	rest chan struct{}
}

type stalledBatchKey struct{}

func newStallAtBatch(match string) *stallAtBatch {
	return &stallAtBatch{match: match, stalled: make(chan struct{}), release: make(chan struct{}), ended: make(chan struct{})}
}

func (s *stallAtBatch) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if s.queries && s.armed.Load() && strings.Contains(d.SQL, s.match) {
		s.once.Do(func() {
			s.on.Store(true)
			close(s.stalled)
			ctx = context.WithValue(ctx, stalledBatchKey{}, true)
		})
	}
	if s.on.Load() {
		<-s.release
		if s.rest != nil && ctx.Value(stalledBatchKey{}) == nil {
			<-s.rest
		}
	}
	return ctx
}

func (s *stallAtBatch) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if ctx.Value(stalledBatchKey{}) != nil {
		close(s.ended)
	}
}

func (s *stallAtBatch) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	if s.armed.Load() && d.Batch != nil && slices.ContainsFunc(d.Batch.QueuedQueries, func(q *pgx.QueuedQuery) bool {
		return strings.Contains(q.SQL, s.match)
	}) {
		s.once.Do(func() {
			s.on.Store(true)
			close(s.stalled)
			ctx = context.WithValue(ctx, stalledBatchKey{}, true)
		})
	}
	if s.on.Load() {
		<-s.release
	}
	return ctx
}

func (s *stallAtBatch) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (s *stallAtBatch) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchEndData) {
	if ctx.Value(stalledBatchKey{}) != nil {
		close(s.ended)
	}
}

// (Helper 107.) A relay's record of a round's outcome is checked against
// the shards' owner by instance id only (deadSQL's owned(): owner = $id
// and the lease live), not against the lease it read the round under.
// Here relay r0 is refused the key's first event for good (too large) and
// stalls (a frozen process) just as it records the dead letter, past its
// lease. A process restarted under the same id (a StatefulSet pod, a
// supervisor's restart) takes the id and the shards once the leases have
// lapsed; meanwhile the topic's limit was raised, and it publishes the
// first and second events. Before it records that, the frozen process
// resumes and its stale record runs: the shards are "r0"'s, so it moves
// the first event, already published by its successor, to outbox_dead.
// The event is then both published and dead-lettered (the multi-relay
// chaos test counts that as a G2 failure: published + dead-lettered !=
// written), and a replay of the dead letter would put it after the second.
//
// The same holds without a restart: a relay that lost its shards to
// another relay (which published the event without yet deleting it) and
// took them back before its stalled record ran. The fix: re-check in the
// record (deadSQL at least) that the shards were held without a break
// since the read, in the database (a per-take epoch or the instance token
// on relay_shards), not by id alone.
func TestAStalledOutcomeDoesNotDeadLetterWhatTheSameIDSuccessorPublished(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.write(t,
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("first")},
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("second")},
	)
	pub := &settlingPublisher{refuse: map[string]bool{"first": true}, hang: map[string]bool{}, hung: make(chan struct{})}
	lease := 600 * time.Millisecond
	cfg := relay.Config{Schema: b.schema, InstanceID: "r0", LeaseDuration: lease, PublishTimeout: 200 * time.Millisecond,
		MaxRetryBackoff: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond}

	// The first process: stalls at the batch that records the dead letter.
	stale := newStallAtBatch("outbox_dead")
	stale.armed.Store(true)
	r1, err := relay.New(pgtest.TracedPool(t, stale, 4), pub, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx1, cancel1 := context.WithCancel(ctx)
	done1 := make(chan error, 1)
	go func() { done1 <- r1.Run(ctx1) }()
	t.Cleanup(func() {
		cancel1()
		select {
		case <-stale.release:
		default:
			close(stale.release)
		}
		<-done1
	})
	waitFor(t, "r0 to stall recording the dead letter", 30*time.Second, closed(stale.stalled))

	// Its instance lease lapses; the topic's limit is raised.
	instances := pgx.Identifier{b.schema, "relay_instances"}.Sanitize()
	waitFor(t, "r0's instance lease to lapse", 30*time.Second, func() bool {
		var lapsed bool
		if err := b.pool.QueryRow(ctx, `SELECT lease_until <= now() FROM `+instances+` WHERE id = 'r0'`).Scan(&lapsed); err != nil {
			t.Fatal(err)
		}
		return lapsed
	})
	pub.setRefused("first", false)

	// The process restarted under r0: it publishes both events and stalls
	// recording that (its round's landing: the delete of its relay_rounds
	// row).
	succ := newStallAtBatch("lo = $2 AND hi = $3")
	succ.armed.Store(true)
	_, stopSucc := b.startRelayWith(t, pgtest.TracedPool(t, succ, 4), pub, cfg)
	waitFor(t, "the successor to publish both events", 30*time.Second, func() bool {
		select {
		case <-succ.stalled:
		default:
			return false
		}
		return slices.Contains(pub.writtenValues(), "second")
	})

	// The frozen process resumes: its stale record runs.
	close(stale.release)
	select {
	case <-stale.ended:
	case <-time.After(30 * time.Second):
		t.Fatal("r0's stalled record did not run within 30s")
	}
	close(succ.release)
	waitFor(t, "the outbox to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	stopSucc()

	written := firstPublications(pub.writtenValues())
	wantNoneBothDeadAndPublished(t, b, written, "the stalled relay's record of its outcome moved it after its successor under the same id published it")
}

// (Helper 107.) The same id-only check in a hand-back: releaseExcess's
// statement (releaseSQL: owner = NULL WHERE owner = $id AND shard =
// ANY(...)) is not bound to this process's token, as releaseAll is. Relay
// r0 owns every shard; a second relay starts, and r0 hands back half of
// them, its statements stalling (a frozen process) just then, past its
// lease. The other relay takes every shard as the leases lapse; a process
// restarted under r0 takes its half back. Then the frozen process resumes
// and its stale hand-back frees the successor's shards in the database,
// while the successor goes on publishing them until its next tick: any
// relay may take them meanwhile, two relays publishing one shard's keys
// (the G3 hazard of 0a83d7a and 705131b, a key's first event dead-lettered
// by one and published late by the other). The fix: hand back only while
// the instance row carries this process's token (as releaseAll does, in
// one transaction), or on relay_shards rows carrying the lease's token.
func TestAStalledHandBackDoesNotFreeTheSameIDSuccessorsShards(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pub := &settlingPublisher{refuse: map[string]bool{}, hang: map[string]bool{}, hung: make(chan struct{})}
	cfg := relay.Config{Schema: b.schema, InstanceID: "r0", LeaseDuration: 600 * time.Millisecond, PublishTimeout: 200 * time.Millisecond,
		MaxRetryBackoff: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond}

	stale := newStallAtBatch("SET owner = NULL, lease_until = NULL WHERE owner = $1 AND shard = ANY")
	stale.queries, stale.rest = true, make(chan struct{})
	r1, err := relay.New(pgtest.TracedPool(t, stale, 4), pub, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx1, cancel1 := context.WithCancel(ctx)
	done1 := make(chan error, 1)
	go func() { done1 <- r1.Run(ctx1) }()
	t.Cleanup(func() {
		cancel1()
		select {
		case <-stale.release:
		default:
			close(stale.release)
		}
		select {
		case <-stale.rest:
		default:
			close(stale.rest)
		}
		<-done1
	})
	waitFor(t, "r0 to own every shard", 30*time.Second, func() bool { return len(r1.OwnedShards()) == relay.NumShards })
	stale.armed.Store(true)

	other := cfg
	other.InstanceID = "b"
	rb, _ := b.startRelayWith(t, b.pool, pub, other)
	waitFor(t, "r0 to stall handing back its excess", 30*time.Second, closed(stale.stalled))
	waitFor(t, "the other relay to take every shard as r0's leases lapse", 30*time.Second, func() bool {
		return len(rb.OwnedShards()) == relay.NumShards
	})

	// The successor's statements pass a gate, held shut (for a moment,
	// well within its lease) while the stale hand-back runs, so that its
	// next tick does not take the freed shards back before they are
	// looked at.
	gate := newGate()
	r2, _ := b.startRelayWith(t, pgtest.TracedPool(t, mrTracer{gate}, 4), pub, cfg) // restarted under r0
	waitFor(t, "r0's successor to take its share", 30*time.Second, func() bool {
		return len(r2.OwnedShards()) == relay.NumShards/2
	})

	gate.pause()
	close(stale.release) // the frozen process resumes
	select {
	case <-stale.ended:
	case <-time.After(30 * time.Second):
		gate.resume()
		t.Fatal("r0's stalled hand-back did not run within 30s")
	}
	held := r2.OwnedShards()
	var freed []int16
	err = b.pool.QueryRow(ctx, `SELECT coalesce(array_agg(shard ORDER BY shard), '{}') FROM `+pgx.Identifier{b.schema, "relay_shards"}.Sanitize()+
		` WHERE shard = ANY($1::smallint[]) AND (owner = 'r0' AND lease_until > now()) IS NOT TRUE`, held).Scan(&freed)
	gate.resume()
	if err != nil {
		t.Fatal(err)
	}
	close(stale.rest)
	t.Logf("successor holds %d shards; %d of them free in the database", len(held), len(freed))
	if len(freed) > 0 {
		t.Errorf("%d shards the successor under r0 holds and publishes (%d..%d) are free in the database after the frozen process's stale hand-back: another relay may take them while it publishes them",
			len(freed), freed[0], freed[len(freed)-1])
	}
}
