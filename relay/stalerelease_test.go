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

// freezeButRelease, once frozen, holds every statement of a relay's pool
// (the process stalled) but its hand-back (releaseSQL), which it lets
// through: the one statement the stalled publish loop was about to send.
type freezeButRelease struct {
	frozen atomic.Bool
	thaw   chan struct{}
}

func (f *freezeButRelease) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if f.frozen.Load() && !strings.Contains(d.SQL, "SET owner = NULL, lease_until = NULL WHERE owner = $1 AND shard = ANY") {
		<-f.thaw
	}
	return ctx
}

func (*freezeButRelease) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// stallMarkOnly holds, once armed, the first mark of a round in flight
// (INSERT INTO relay_rounds) until released, and nothing else: one slow
// statement between a round's read and its publish, the relay's lease
// ticks going on beside it.
type stallMarkOnly struct {
	armed   atomic.Bool
	once    sync.Once
	stalled chan struct{}
	release chan struct{}
	marked  chan struct{} // closed once the held mark is written
}

type heldMarkKey struct{}

func (s *stallMarkOnly) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if s.armed.Load() && strings.HasPrefix(d.SQL, "INSERT INTO") && strings.Contains(d.SQL, "relay_rounds") {
		hold := false
		s.once.Do(func() { hold = true; close(s.stalled) })
		if hold {
			<-s.release
			ctx = context.WithValue(ctx, heldMarkKey{}, true)
		}
	}
	return ctx
}

func (s *stallMarkOnly) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if ctx.Value(heldMarkKey{}) != nil {
		close(s.marked)
	}
}

// A hand-back (releaseSQL) matches the instance id only, not the process
// token: a process that stalled just before sending one, past its lease,
// and resumed after a successor under the same instance id took the
// shards, frees the successor's shards in the database. The successor's
// losses counter does not see it until its next lease tick (a third of the
// lease later, at worst: 2 s by default), and stillHeld passes meanwhile:
// a round it read before, published after another relay took a freed
// shard, dead-lettered a key's first event and published the next, puts
// the first after the second (G3), and publishes an event also in
// outbox_dead (G7).
//
// Scenario: P0 (instance id "X") owns every shard; a second relay joins,
// so P0 hands back its excess (shards 128-255) and stalls (the process
// paused) right before sending the hand-back; its leases and instance row
// lapse; the other relay leaves. P1 is started under the same id "X" (a
// rescheduled pod keeps its name): it takes the row and every shard, and
// reads key K's "first" and "second" (shard 134); its mark of the round is
// slow. P0 resumes and its hand-back goes out: shards 128-255 are free,
// though P1 holds them, its leases valid and renewed on time. Relay "B"
// takes them, dead-letters "first" (too large) and publishes "second"; the
// topic's limit is raised. P1's round goes on: stillHeld (no tick since,
// its leases valid) and it publishes "first" after "second".
//
// Suggested fix: releaseSQL must free only shards this process holds:
// check the instance row's token as releaseAllSQL does (AND EXISTS
// (SELECT 1 FROM relay_instances WHERE id = $1 AND token = $3)), or match
// each shard's lease_until to this process's last renewal (as
// releaseLeasesSQL then did; it matches the take's epoch now). (Other same-id writes that change ownership while
// a lease is valid would need the same.)
func TestAStaleHandBackUnderTheSameInstanceIDDoesNotLetTheSuccessorPublishOutOfOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pub := &settlingPublisher{refuse: map[string]bool{"first": true}, hang: map[string]bool{}, hung: make(chan struct{})}

	// P0: instance id "X", the process that will stall.
	freeze := &freezeButRelease{thaw: make(chan struct{})}
	atRelease, goOn, released := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var releaseOnce, releasedOnce sync.Once
	cfg := relay.Config{Schema: b.schema, InstanceID: "X", LeaseDuration: 600 * time.Millisecond, PollInterval: 50 * time.Millisecond,
		PublishTimeout: 200 * time.Millisecond, MaxRetryBackoff: 50 * time.Millisecond}
	p0, err := relay.New(pgtest.TracedPool(t, freeze, 4), &settlingPublisher{refuse: map[string]bool{}, hang: map[string]bool{}}, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	relay.SetLeaseTestHook(p0, func(point string) {
		switch point {
		case "release":
			first := false
			releaseOnce.Do(func() { first = true; close(atRelease) })
			if first {
				<-goOn
			}
		case "released":
			releasedOnce.Do(func() { close(released) })
		}
	})
	p0ctx, stopP0 := context.WithCancel(context.Background())
	p0done := make(chan error, 1)
	go func() { p0done <- p0.Run(p0ctx) }()
	t.Cleanup(func() {
		stopP0()
		select {
		case <-goOn:
		default:
			close(goOn)
		}
		select {
		case <-freeze.thaw:
		default:
			close(freeze.thaw)
		}
		<-p0done // its id is P1's: an InstanceInUseError is fine here
	})
	waitFor(t, "P0 to own every shard", 30*time.Second, func() bool { return len(p0.OwnedShards()) == relay.NumShards })

	// Another relay joins: P0's fair share halves, and it hands back 128.
	hcfg := cfg
	hcfg.InstanceID = "helper"
	_, stopHelper := b.startRelayWith(t, b.pool, &settlingPublisher{refuse: map[string]bool{}, hang: map[string]bool{}}, hcfg)
	waitFor(t, "P0 to start a hand-back", 30*time.Second, closed(atRelease))
	freeze.frozen.Store(true) // P0 stalls, right before its hand-back goes out
	stopHelper()

	instances := pgx.Identifier{b.schema, "relay_instances"}.Sanitize()
	shardsT := pgx.Identifier{b.schema, "relay_shards"}.Sanitize()
	waitFor(t, "P0's instance row and leases to lapse", 30*time.Second, func() bool {
		var lapsed bool
		if err := b.pool.QueryRow(ctx, `SELECT (SELECT lease_until <= now() FROM `+instances+` WHERE id = 'X')
			AND NOT EXISTS (SELECT 1 FROM `+shardsT+` WHERE lease_until > now())`).Scan(&lapsed); err != nil {
			t.Fatal(err)
		}
		return lapsed
	})

	// P1: the same instance id, another process. A long lease: its ticks
	// come every 10 s, renewing on time.
	mark := &stallMarkOnly{stalled: make(chan struct{}), release: make(chan struct{}), marked: make(chan struct{})}
	p1cfg := cfg
	p1cfg.LeaseDuration = 30 * time.Second
	p1, _ := b.startRelayWith(t, pgtest.TracedPool(t, mark, 4), pub, p1cfg)
	t.Cleanup(func() { // before P1's stop
		select {
		case <-mark.release:
		default:
			close(mark.release)
		}
	})
	waitFor(t, "P1 to own every shard", 30*time.Second, func() bool { return len(p1.OwnedShards()) == relay.NumShards })
	mark.armed.Store(true)
	b.write(t, // key K is on shard 134, among those P0 hands back
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("first")},
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("second")},
	)
	waitFor(t, "P1 to read the round", 30*time.Second, closed(mark.stalled))

	close(goOn) // P0 resumes: its hand-back goes out
	waitFor(t, "P0's hand-back", 30*time.Second, closed(released))
	var freed int
	if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM `+shardsT+` WHERE owner IS NULL`).Scan(&freed); err != nil {
		t.Fatal(err)
	}
	t.Logf("P0's stale hand-back freed %d of P1's shards", freed)
	if freed == 0 {
		return // the hand-back left the successor's shards alone: the hole is closed
	}

	bcfg := cfg
	bcfg.InstanceID = "B"
	_, stopB := b.startRelayWith(t, b.pool, pub, bcfg)
	waitFor(t, "relay B to settle both events", 30*time.Second, func() bool {
		return b.count(t, "outbox") == 0 && b.count(t, "outbox_dead") == 1
	})
	stopB()
	pub.setRefused("first", false) // the topic's limit raised

	close(mark.release) // P1's round goes on
	b.waitRoundLetGo(t, "P1 to let its round go", mark.marked, "X")
	wantOnlySecondWritten(t, pub, "relay B, on shards P0's stale hand-back freed under P1 (same instance id), dead-lettered the first event and published the second")
}
