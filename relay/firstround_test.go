package relay_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// A round that failed whole for one key (a key stuck behind a partition
// that refuses writes, met before it is known to be stuck) leaves its
// outcome to record: its first event's error and attempt. The next round's
// read does not wait for that: the key is held back, so the read cannot
// meet those events, and the other keys go to Kafka while the failure is
// being written. The relay used to read only once the record had landed
// (an UPDATE of a round of rows, 40 ms at 1,000), on the critical path of
// every key. The record is held up here by a lock on the key's rows.
func TestOtherKeysGoOutWhileAFailedRoundIsRecorded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 4)
	var msgs []outbox.Message
	for i := range 30 {
		msgs = append(msgs, outbox.Message{Topic: "stuck", Key: []byte("K"), Value: []byte(fmt.Sprint(i))})
	}
	for i := range 20 {
		msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprintf("other-%d", i%10)), Value: []byte(fmt.Sprint(i))})
	}
	b.write(t, msgs...)
	ctx := context.Background()
	table := pgx.Identifier{b.schema, "outbox"}.Sanitize()

	lock, err := pgtest.Conn(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback(ctx) }()
	if _, err := lock.Exec(ctx, `SELECT 1 FROM `+table+` WHERE key = 'K' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}

	pub := &refusingPublisher{Publisher: b.publisher(t), topic: "stuck"}
	b.startRelayWith(t, b.pool, pub, relay.Config{BatchSize: 10, LeaseDuration: 10 * time.Second})

	// The first round (K's first 10 events) failed; its outcome waits for
	// the lock, and the other keys' first round goes out meanwhile.
	got := b.kafka.ReadAll(t, topic, 10, 15*time.Second)
	var recorded int
	if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE key = 'K' AND attempts > 0`).Scan(&recorded); err != nil {
		t.Fatal(err)
	}
	if len(got) < 10 {
		t.Fatalf("%d records of the other keys reached Kafka while K's failed round was being recorded, want 10", len(got))
	}
	if recorded != 0 {
		t.Fatalf("%d events of K have their failure recorded while their rows are locked", recorded)
	}

	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the other keys to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 30 })
	// The failed round's outcome was recorded once the lock went: K's
	// first event carries an attempt and its error. Its next 9 carry
	// none: only a key's first failed event is charged, the one retried
	// (the others wait behind it, never sent again meanwhile).
	var n, first, later int
	if err := b.pool.QueryRow(ctx, `SELECT count(*),
    count(*) FILTER (WHERE rn = 1 AND attempts >= 1 AND last_error IS NOT NULL),
    count(*) FILTER (WHERE rn > 1 AND attempts = 0 AND last_error IS NULL)
FROM (SELECT attempts, last_error, row_number() OVER (ORDER BY id) AS rn FROM `+table+` WHERE key = 'K' ORDER BY id LIMIT 10) k`).Scan(&n, &first, &later); err != nil {
		t.Fatal(err)
	}
	if n != 10 || first != 1 || later != 9 {
		t.Fatalf("K's first 10 events: the first charged %d, %d of the next %d uncharged; want 1, 9 of 9", first, later, n-1)
	}
	records := b.kafka.ReadAll(t, topic, 20, 15*time.Second)
	byKey := map[string][]string{}
	seen := map[string]bool{}
	for _, r := range records {
		if id := messageID(r); !seen[id] {
			seen[id] = true
			byKey[string(r.Key)] = append(byKey[string(r.Key)], string(r.Value))
		}
	}
	if len(seen) != 20 {
		t.Fatalf("%d distinct events of the other keys in Kafka, want 20", len(seen))
	}
	for i := range 10 {
		k := fmt.Sprintf("other-%d", i)
		if want := []string{fmt.Sprint(i), fmt.Sprint(i + 10)}; fmt.Sprint(byKey[k]) != fmt.Sprint(want) {
			t.Errorf("key %s first published %v, want %v", k, byKey[k], want)
		}
	}
}

// lockingPublisher answers "unknown topic", then a passing error (an
// outage) after taking lock (which holds up the recording of that answer),
// then "unknown topic" again; it notes when it answered.
type lockingPublisher struct {
	lock    func()
	mu      sync.Mutex
	calls   []time.Time
	againAt time.Time // first "unknown topic" after the outage
}

func (p *lockingPublisher) Publish(_ context.Context, records []relay.Record) []error {
	p.mu.Lock()
	n := len(p.calls)
	p.calls = append(p.calls, time.Now())
	p.mu.Unlock()
	err := fmt.Errorf("%w: UNKNOWN_TOPIC_OR_PARTITION", relay.ErrUnknownTopic)
	switch {
	case n == 1:
		p.lock()
		err = errors.New("broker down")
	case n > 1:
		p.mu.Lock()
		if p.againAt.IsZero() {
			p.againAt = p.calls[n]
		}
		p.mu.Unlock()
	}
	errs := make([]error, len(records))
	for i := range errs {
		errs[i] = err
	}
	return errs
}

func (p *lockingPublisher) Close() error { return nil }

// A key whose retry comes due while its last failure is still being
// recorded is read only once that record has landed: read before, its
// event would carry the refusal run the failure ended (unknown topic since
// long ago, where an outage answered last) and be dead-lettered at the
// next "unknown topic" instead of after a fresh grace (G7). The record is
// held up here by a lock on the event's row.
func TestARetryDueWhileItsFailureIsRecordedReadsTheRecordedRow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.write(t, outbox.Message{Topic: "t", Key: []byte("k"), Value: []byte("v")})
	ctx := context.Background()
	table := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	lockConn := pgtest.Conn(t)
	var lock pgx.Tx
	locked := make(chan struct{})
	pub := &lockingPublisher{lock: func() {
		var err error
		if lock, err = lockConn.Begin(ctx); err == nil {
			_, err = lock.Exec(ctx, `SELECT 1 FROM `+table+` FOR UPDATE`)
		}
		if err != nil {
			t.Error(err)
		}
		close(locked)
	}}
	const grace = 100 * time.Millisecond
	b.startRelayWith(t, b.pool, pub, relay.Config{UnknownTopicGrace: grace, MaxRetryBackoff: 200 * time.Millisecond})
	select {
	case <-locked:
	case <-time.After(30 * time.Second):
		t.Fatal("the relay did not retry the event")
	}
	// Hold the outage's record up until the key's retry is due (its
	// backoff is at most 300 ms) and a while past it.
	waitFor(t, "the outage's record to wait on the lock", 10*time.Second, func() bool {
		var n int
		_ = b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE '||$1||'%'`, table).Scan(&n)
		return n > 0
	})
	time.Sleep(time.Second)
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the event to be dead-lettered", 30*time.Second, func() bool { return b.count(t, "outbox_dead") == 1 })
	pub.mu.Lock()
	defer pub.mu.Unlock()
	last := pub.calls[len(pub.calls)-1]
	if pub.againAt.IsZero() || last.Sub(pub.againAt) < grace*8/10 {
		t.Fatalf("dead-lettered %s after the first unknown-topic answer that followed the outage (calls at %v); the grace (%s) counts from there",
			last.Sub(pub.againAt), pub.calls, grace)
	}
}
