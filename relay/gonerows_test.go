package relay_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
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
			var msgs []outbox.Message
			for i := range 20 {
				msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint("k", i%5)), Value: []byte(fmt.Sprint(i))})
			}
			b.write(t, msgs...)
			pub := &gatedPublisher{Publisher: b.publisher(t), inFlight: make(chan struct{}), release: make(chan struct{})}
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
