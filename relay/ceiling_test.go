package relay_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// failKeysPublisher fails every record of the given keys with a passing
// error and acknowledges the others.
type failKeysPublisher struct {
	mu   sync.Mutex
	fail map[string]bool
}

func (p *failKeysPublisher) Publish(_ context.Context, records []relay.Record) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	errs := make([]error, len(records))
	for i, r := range records {
		if p.fail[string(r.Key)] {
			errs[i] = errors.New("not enough replicas")
		}
	}
	return errs
}

func (p *failKeysPublisher) Close() error { return nil }

// Config.MaxHeldKeys reached: key A is held, key B's failed event stands
// as the ceiling (read, then dropped, on every claim). The newest id is a
// later event of held key A, which no claim reads before A's retry: the
// probe must not make the relay read its shards on every ProbeInterval.
func TestRelayUnderACeilingDoesNotReadEveryProbe(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool, counter := countingPool(t)
	pub := &failKeysPublisher{fail: map[string]bool{"A": true, "B": true}}
	b.write(t,
		outbox.Message{Topic: "t", Key: []byte("A"), Value: []byte("A1")},
		outbox.Message{Topic: "t", Key: []byte("B"), Value: []byte("B1")},
	)
	b.startRelayWith(t, pool, pub, relay.Config{PollInterval: 2 * time.Second, MaxRetryBackoff: 2 * time.Second, MaxHeldKeys: 1})
	waitFor(t, "both events to fail", 30*time.Second, func() bool {
		var n int
		_ = b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{b.schema, "outbox"}.Sanitize()+` WHERE attempts > 0`).Scan(&n)
		return n == 2
	})
	b.write(t, outbox.Message{Topic: "t", Key: []byte("A"), Value: []byte("A2")})
	const window = 6 * time.Second
	claims := claimsIn(counter, window)
	t.Logf("%d claims in %s", claims, window)
	// PollInterval 2 s, A's retries every 2 s at most: about 6; allow 40.
	if claims > 40 {
		t.Fatalf("the relay read its shards %d times in %s with nothing it may publish (PollInterval 2s): it re-reads on every probe", claims, window)
	}
}

// sickPartitionPublisher puts keys starting with "s" on partition 0, which
// fails every record with a passing error, and the others on partition 1,
// which acknowledges them.
type sickPartitionPublisher struct{}

func (sickPartitionPublisher) Partition(_ string, key []byte) (int32, bool) {
	if len(key) > 0 && key[0] == 's' {
		return 0, true
	}
	return 1, true
}

func (sickPartitionPublisher) Publish(_ context.Context, records []relay.Record) []error {
	errs := make([]error, len(records))
	for i, r := range records {
		if len(r.Key) > 0 && r.Key[0] == 's' {
			errs[i] = errors.New("not enough replicas")
		}
	}
	return errs
}

func (sickPartitionPublisher) Close() error { return nil }

// Config.MaxHeldKeys reached on a failing partition: its events from the
// ceiling up are not read (Config.MaxHeldKeys: "other partitions go on").
// With more of them pending than a round holds, ahead of a healthy
// partition's event in id order, the healthy event must still be
// published while the failing partition stays down.
func TestRelayCeilingDoesNotStarveOtherPartitions(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var msgs []outbox.Message
	for i := range 6 {
		msgs = append(msgs, outbox.Message{Topic: "t", Key: []byte{'s', byte('0' + i)}, Value: []byte("sick")})
	}
	msgs = append(msgs, outbox.Message{Topic: "t", Key: []byte("healthy"), Value: []byte("ok")})
	b.write(t, msgs...)
	b.startRelayWith(t, b.pool, sickPartitionPublisher{}, relay.Config{BatchSize: 2, MaxHeldKeys: 1, MaxRetryBackoff: time.Second})
	waitFor(t, "the healthy partition's event published", 15*time.Second, func() bool {
		var n int
		_ = b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{b.schema, "outbox"}.Sanitize()+` WHERE key = 'healthy'`).Scan(&n)
		return n == 0
	})
}

// crossTopicPublisher fails L's, M's and, on topic t, K's records as an
// unknown topic (within its grace: retried, not dead-lettered) and
// acknowledges the rest; K's records of topic t go to partition 1, every
// other record to partition 0.
type crossTopicPublisher struct {
	mu    sync.Mutex
	acked []string // topic/key, in the order acknowledged
}

func (p *crossTopicPublisher) Partition(topic string, key []byte) (int32, bool) {
	if topic == "t" && string(key) == "K" {
		return 1, true
	}
	return 0, true
}

func (p *crossTopicPublisher) Publish(_ context.Context, records []relay.Record) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	errs := make([]error, len(records))
	for i, r := range records {
		if k := string(r.Key); k == "L" || k == "M" || k == "K" && r.Topic == "t" {
			errs[i] = fmt.Errorf("produce: %w", relay.ErrUnknownTopic)
			continue
		}
		p.acked = append(p.acked, r.Topic+"/"+string(r.Key))
	}
	return errs
}

func (p *crossTopicPublisher) Close() error { return nil }

func (p *crossTopicPublisher) published(topicKey string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Contains(p.acked, topicKey)
}

// A key whose failed event a ceiling stopped (Config.MaxHeldKeys reached)
// publishes none of its later events, on another topic either, while the
// ceiling stands: also once the ids the ceilings stopped fill their cap
// (4,096). The key was noted only while there was room, so its event on
// another topic went out before its failed one (G3; found by a review).
func TestACeilingStopsAKeysEventsOnOtherTopicsOnceTheSkippedIdsAreFull(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pub := &crossTopicPublisher{}
	table := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	// L is held (the cap is one key); M's failure raises a ceiling on
	// partition (t, 0).
	b.write(t, outbox.Message{Topic: "t", Key: []byte("L"), Value: []byte("L1")},
		outbox.Message{Topic: "t", Key: []byte("M"), Value: []byte("M1")})
	b.startRelayWith(t, b.pool, pub, relay.Config{BatchSize: 100, MaxHeldKeys: 1, UnknownTopicGrace: time.Hour, MaxRetryBackoff: time.Second})
	waitFor(t, "L's and M's events to fail", 20*time.Second, func() bool {
		var n int
		_ = b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+table+` WHERE attempts > 0`).Scan(&n)
		return n == 2
	})
	// More events above M's ceiling than the stopped ids' cap, then K's
	// first event (t, partition 1: it fails, and the cap being reached, a
	// ceiling stops it) and K's second on topic u (a round holds one topic
	// of a key: it is read in a later round).
	var msgs []outbox.Message
	for i := range 4100 {
		msgs = append(msgs, outbox.Message{Topic: "t", Key: []byte(fmt.Sprint("x", i)), Value: []byte("x")})
	}
	b.write(t, append(msgs, outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("K1")},
		outbox.Message{Topic: "u", Key: []byte("K"), Value: []byte("K2")})...)
	waitFor(t, "K's first event to fail", 20*time.Second, func() bool {
		var n int
		_ = b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+table+` WHERE key = 'K' AND topic = 't' AND attempts > 0`).Scan(&n)
		return n == 1
	})
	// An event written after that, published, shows the reads went past
	// K's second event since.
	b.write(t, outbox.Message{Topic: "u", Key: []byte("Z"), Value: []byte("Z")})
	waitFor(t, "Z, written after K's events, published", 20*time.Second, func() bool { return pub.published("u/Z") })
	if pub.published("u/K") {
		t.Fatal("K's second event (topic u) was published while its first (topic t) waits behind a ceiling (G3)")
	}
}
