package relay_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

// notDeletedObserver sums BatchStats.NotDeleted.
type notDeletedObserver struct {
	mu         sync.Mutex
	notDeleted int
}

func (o *notDeletedObserver) ObserveBatch(s relay.BatchStats) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.notDeleted += s.NotDeleted
}

func (*notDeletedObserver) ObserveShards(int) {}

func (o *notDeletedObserver) get() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.notDeleted
}

// A round's events deleted from the outbox while they were with Kafka (an
// operator's DELETE or TRUNCATE) are not events left to a shard's new
// owner: the relay logged "lost shard ownership mid-round; the new owner
// republishes" and counted them in onceflow_relay_ownership_lost_total
// though it held every shard and nobody would publish them again. Only
// events still pending on a shard it lost are counted and logged so.
func TestEventsDeletedByHandMidRoundAreNotCountedAsOwnershipLost(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name    string
		meddle  func(t *testing.T, b *bundle, outboxTable, shardsTable string)
		wantNot int // NotDeleted a round: its events left pending for another owner
		wantLog string
		notLog  string
	}{
		{
			name: "deleted by hand",
			meddle: func(t *testing.T, b *bundle, outboxTable, _ string) {
				if _, err := b.pool.Exec(context.Background(), `DELETE FROM `+outboxTable); err != nil {
					t.Fatal(err)
				}
			},
			wantNot: 0,
			wantLog: `msg="relay: published events were no longer in the outbox`,
			notLog:  `lost shard ownership`,
		},
		{
			name: "shards taken",
			meddle: func(t *testing.T, b *bundle, _, shardsTable string) {
				// Another relay holds every shard now (the lease lapsed
				// and it took them): the round's events stay for it.
				if _, err := b.pool.Exec(context.Background(), `UPDATE `+shardsTable+` SET owner = 'someone-else', lease_until = now() + interval '1 hour'`); err != nil {
					t.Fatal(err)
				}
			},
			wantNot: 20,
			wantLog: `msg="relay: lost shard ownership mid-round; the new owner republishes" instance=\S+ events=20`,
			notLog:  `no longer in the outbox`,
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			topic := b.kafka.Topic(t, 4)
			b.writeOverFiveKeys(t, topic, 20)
			pub := gate(b.publisher(t))
			logger, logs := newLogger(slog.LevelInfo)
			obs := &notDeletedObserver{}
			_, stop := b.startRelayWith(t, b.pool, pub, relay.Config{Logger: logger, Observer: obs, BatchSize: 100, LeaseDuration: 6 * time.Second})
			defer stop()
			select {
			case <-pub.inFlight:
			case <-time.After(30 * time.Second):
				t.Fatal("the relay published nothing")
			}
			c.meddle(t, b, pgx.Identifier{b.schema, "outbox"}.Sanitize(), pgx.Identifier{b.schema, "relay_shards"}.Sanitize())
			close(pub.release)
			waitFor(t, "the round to be recorded", 30*time.Second, func() bool {
				return len(logs.lines(c.wantLog)) > 0
			})
			// Until a lease tick says which shards it lost, the relay read
			// and published the lost shards' events again every round: 45
			// rounds of them in the 2 s to the next tick (a third of the
			// default lease). A refused delete brings the tick forward.
			time.Sleep(3 * time.Second)
			lostRounds := len(logs.lines(`lost shard ownership`))
			if lostRounds > 3 {
				t.Errorf("the relay published the lost shards' events in %d rounds, want at most 3: it goes on until its next lease tick", lostRounds)
			}
			if got := obs.get(); got != c.wantNot*lostRounds {
				t.Errorf("BatchStats.NotDeleted = %d over %d rounds, want %d a round", got, lostRounds, c.wantNot)
			}
			if bad := logs.lines(c.notLog); len(bad) > 0 {
				t.Errorf("the relay logged %q:\n%s", c.notLog, bad)
			}
		})
	}
}

// racingPublisher publishes, and once racing is set deletes each call's
// events from the outbox after it, as a shard's new owner that published
// and deleted them first would; it counts the calls made while racing.
type racingPublisher struct {
	relay.Publisher
	deleteEvents func(eventIDs []string)
	racing       atomic.Bool
	racingCalls  atomic.Int32
	inFlight     chan struct{}
	release      chan struct{}
	once         sync.Once
}

func (p *racingPublisher) Publish(ctx context.Context, records []relay.Record) []error {
	p.once.Do(func() { close(p.inFlight) })
	<-p.release
	errs := p.Publisher.Publish(ctx, records)
	if p.racing.Load() {
		p.racingCalls.Add(1)
		var ids []string
		for _, r := range records {
			for _, h := range r.Headers {
				if h.Key == relay.MessageIDHeader {
					ids = append(ids, string(h.Value))
				}
			}
		}
		p.deleteEvents(ids)
	}
	return errs
}

// A relay whose shards were taken, and whose events their new owner
// published and deleted before this relay recorded its round, finds them
// gone rather than left to the new owner: that too must bring the lease
// tick forward, or it reads and publishes the lost shards' new events
// round after round until its regular tick (30 rounds in 3 s with a 30 s
// lease; helper 73).
func TestEventsTheNewOwnerDeletedAlsoBringTheTickForward(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	topic := b.kafka.Topic(t, 4)
	b.writeOverFiveKeys(t, topic, 20)
	pub := &racingPublisher{Publisher: b.publisher(t), inFlight: make(chan struct{}), release: make(chan struct{})}
	pub.deleteEvents = func(ids []string) {
		if _, err := b.pool.Exec(ctx, `DELETE FROM `+pgx.Identifier{b.schema, "outbox"}.Sanitize()+` WHERE event_id::text = ANY($1)`, ids); err != nil {
			t.Error(err)
		}
	}
	logger, logs := newLogger(slog.LevelInfo)
	_, stop := b.startRelayWith(t, b.pool, pub, relay.Config{Logger: logger, BatchSize: 100, LeaseDuration: 30 * time.Second})
	defer stop()
	<-pub.inFlight
	if _, err := b.pool.Exec(ctx, `UPDATE `+pgx.Identifier{b.schema, "relay_shards"}.Sanitize()+` SET owner = 'someone-else', lease_until = now() + interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	pub.racing.Store(true)
	close(pub.release)
	waitFor(t, "the round to be recorded", 30*time.Second, func() bool {
		return len(logs.lines(`no longer in the outbox`)) > 0
	})
	// Writers go on writing events of the shards the other relay holds.
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		b.write(t, outbox.Message{Topic: topic, Key: []byte("k1"), Value: []byte("more")})
	}
	if calls := pub.racingCalls.Load(); calls > 3 {
		t.Errorf("the relay published the lost shards' events in %d rounds over 3 s, want at most 3", calls)
	}
}

// deadObserver sums what the rounds reported dead-lettered.
type deadObserver struct {
	mu           sync.Mutex
	dead, rounds int
}

func (o *deadObserver) ObserveBatch(s relay.BatchStats) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if s.DeadLettered > 0 {
		o.rounds++
	}
	o.dead += s.DeadLettered
}

func (*deadObserver) ObserveShards(int) {}

// Events Kafka refused for good, on shards taken mid-round, are not moved
// to outbox_dead (the new owner retries them): the relay reported them
// dead-lettered all the same (BatchStats.DeadLettered,
// onceflow_relay_dead_lettered_total: "moved to outbox_dead"), and tried
// again every round until its next lease tick (64 rounds in 3 s with a
// 30 s lease; helper 73).
func TestRefusedEventsOfALostShardAreNotReportedDeadLettered(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 4)
	var msgs []outbox.Message
	for i := range 5 {
		msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint("k", i)), Value: bytes.Repeat([]byte("x"), 4096)})
	}
	b.write(t, msgs...)
	small, err := kgopublisher.New(b.kafka.Brokers, &kgopublisher.Config{MaxRecordBytes: 1024})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = small.Close() })
	pub := gate(small)
	logger, logs := newLogger(slog.LevelInfo)
	obs := &deadObserver{}
	_, stop := b.startRelayWith(t, b.pool, pub, relay.Config{Logger: logger, Observer: obs, LeaseDuration: 30 * time.Second})
	defer stop()
	<-pub.inFlight
	if _, err := b.pool.Exec(context.Background(), `UPDATE `+pgx.Identifier{b.schema, "relay_shards"}.Sanitize()+` SET owner = 'someone-else', lease_until = now() + interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	close(pub.release)
	waitFor(t, "the round to be recorded", 30*time.Second, func() bool {
		return len(logs.lines(`not moved to outbox_dead`)) > 0
	})
	time.Sleep(3 * time.Second)
	obs.mu.Lock()
	defer obs.mu.Unlock()
	if moved := b.count(t, "outbox_dead"); obs.dead != moved {
		t.Errorf("BatchStats.DeadLettered summed to %d, but %d events were moved to outbox_dead", obs.dead, moved)
	}
	if tries := len(logs.lines(`not moved to outbox_dead`)); tries > 3 {
		t.Errorf("the relay tried to dead-letter the lost shards' events in %d rounds over 3 s, want at most 3", tries)
	}
}
