package relay_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

// recordingPublisher passes records to a real publisher and notes the
// values it acknowledged, in the order their calls returned.
type recordingPublisher struct {
	relay.Publisher
	mu      sync.Mutex
	acked   []string
	notSent atomic.Int64 // records failed with relay.ErrNotSent
}

func (p *recordingPublisher) Publish(ctx context.Context, records []relay.Record) []error {
	errs := p.Publisher.Publish(ctx, records)
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, err := range errs {
		if err == nil {
			p.acked = append(p.acked, string(records[i].Value))
		}
		if errors.Is(err, relay.ErrNotSent) {
			p.notSent.Add(1)
		}
	}
	return errs
}

func (p *recordingPublisher) ackedValues() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.acked)
}

// A key's later event may go out once its earlier event is dead-lettered,
// but only once that is recorded: if the dead-letter's statement fails,
// the earlier event is still pending, and if its topic is created in the
// meantime it is published, so the later event must not have gone out
// before it (G3). Here the key's first event waited out its unknown
// topic's grace; its dead-letter fails once, slowly (a database failing
// over), and the topic is created while it hangs. In rounds of two, the
// later event is read ahead while the first is with Kafka; in rounds of
// the default size, the first round reads both and publishes the first
// alone (one topic per key a round), and the later one is read again.
func TestALaterEventWaitsForItsKeysDeadLetterToBeRecorded(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{2, 0} {
		t.Run(fmt.Sprintf("batch %d", batch), func(t *testing.T) {
			t.Parallel()
			laterEventWaitsForDeadLetter(t, batch)
		})
	}
}

func laterEventWaitsForDeadLetter(t *testing.T, batch int) {
	b := setup(t)
	ctx := context.Background()
	missing := "created-late-" + b.schema
	existing := b.kafka.Topic(t, 1)
	b.write(t,
		outbox.Message{Topic: missing, Key: []byte("K"), Value: []byte("first")},
		outbox.Message{Topic: existing, Key: []byte("other"), Value: []byte("other")},
		outbox.Message{Topic: existing, Key: []byte("K"), Value: []byte("second")},
	)
	// The first event's topic has been unknown for an hour: its grace
	// (a minute) is over when the relay first tries it.
	if _, err := b.pool.Exec(ctx, `UPDATE `+pgx.Identifier{b.schema, "outbox"}.Sanitize()+
		` SET first_refused_at = now() - interval '1 hour', refused_kind = 1 WHERE value = 'first'`); err != nil {
		t.Fatal(err)
	}
	deadLetterStarted := failFirstDeadLetter(t, b, 1500*time.Millisecond)
	pub := &recordingPublisher{Publisher: b.publisher(t)}
	b.startRelayWith(t, b.pool, pub, relay.Config{BatchSize: batch})

	waitFor(t, "the first dead-letter attempt", 30*time.Second, deadLetterStarted)
	b.kafka.CreateTopic(t, missing, 1, nil) // while the dead-letter hangs
	waitFor(t, "the outbox to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })

	acked := slices.DeleteFunc(firstPublications(pub.ackedValues()), func(v string) bool { return v == "other" })
	checkSettledInOrder(t, b, acked)
}

// checkSettledInOrder checks how a key's two events, "first" and
// "second", were settled: "first" published before "second", or
// dead-lettered and "second" published.
func checkSettledInOrder(t *testing.T, b *bundle, firstPublished []string) {
	t.Helper()
	dead := b.count(t, "outbox_dead")
	t.Logf("first publications %v, dead-lettered %d", firstPublished, dead)
	switch {
	case slices.Equal(firstPublished, []string{"first", "second"}) && dead == 0:
		// The dead letter failed, and the first event went out on its retry.
	case slices.Equal(firstPublished, []string{"second"}) && dead == 1:
		// The retry dead-lettered it.
	default:
		t.Fatalf("first published %v with %d dead-lettered: the key's later event went out before its first event was settled", firstPublished, dead)
	}
}

// failFirstDeadLetter makes the relay's first dead letter in b's schema
// hang for hang, then fail (a database going away); later ones pass. A
// sequence counts the attempts across the failed transactions. It returns
// whether the first attempt has begun.
func failFirstDeadLetter(t *testing.T, b *bundle, hang time.Duration) (started func() bool) {
	t.Helper()
	ctx := context.Background()
	q := func(name string) string { return pgx.Identifier{b.schema, name}.Sanitize() }
	for _, s := range []string{
		`CREATE SEQUENCE ` + q("dead_letter_attempts"),
		`CREATE FUNCTION ` + q("fail_first_dead_letter") + `() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF nextval('` + q("dead_letter_attempts") + `') = 1 THEN
        PERFORM pg_sleep(` + fmt.Sprint(hang.Seconds()) + `);
        RAISE EXCEPTION 'injected: the database went away';
    END IF;
    RETURN NEW;
END $$`,
		`CREATE TRIGGER fail_first_dead_letter BEFORE INSERT ON ` + q("outbox_dead") +
			` FOR EACH ROW EXECUTE FUNCTION ` + q("fail_first_dead_letter") + `()`,
	} {
		if _, err := b.pool.Exec(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	return func() bool {
		var called bool
		if err := b.pool.QueryRow(ctx, `SELECT is_called FROM `+q("dead_letter_attempts")).Scan(&called); err != nil {
			t.Fatal(err)
		}
		return called
	}
}

// The same within one round: the broker refuses a batch holding a key's
// first event, too large for the topic, and its later event. The relay
// dead-letters the first (it is refused alone too) and must not publish
// the later one before the dead letter is recorded. The dead letter fails;
// meanwhile the operator raises the topic's max.message.bytes.
func TestALaterEventInTheRoundWaitsForItsKeysDeadLetter(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	topic := "small-" + b.schema
	limit, raised := "4000", "10000000"
	b.kafka.CreateTopic(t, topic, 1, map[string]*string{"max.message.bytes": &limit})
	b.write(t,
		outbox.Message{Topic: topic, Key: []byte("K"), Value: incompressible("first", 6000)},
		outbox.Message{Topic: topic, Key: []byte("K"), Value: []byte("second")},
	)
	deadLetterStarted := failFirstDeadLetter(t, b, 1500*time.Millisecond)
	pub := &recordingPublisher{Publisher: b.publisher(t)}
	b.startRelayWith(t, b.pool, pub, relay.Config{})
	waitFor(t, "the first dead-letter attempt", 30*time.Second, deadLetterStarted)
	resp, err := b.kafka.Admin(t).AlterTopicConfigs(ctx, []kadm.AlterConfig{{Op: kadm.SetConfig, Name: "max.message.bytes", Value: &raised}}, topic)
	if err == nil {
		_, err = resp.On(topic, nil)
	}
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the outbox to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	checkSettledInOrder(t, b, shortValues(firstPublications(pub.ackedValues())))
}

// The same when the client refuses the first event for its size by itself
// and the broker would take the later one in the same call. The dead
// letter fails while the relay stops (a rolling restart), and the relay
// comes back with a larger limit.
func TestALaterEventInTheCallWaitsForItsKeysDeadLetterAcrossARestart(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 1)
	b.write(t,
		outbox.Message{Topic: topic, Key: []byte("K"), Value: incompressible("first", 6000)},
		outbox.Message{Topic: topic, Key: []byte("K"), Value: []byte("second")},
	)
	deadLetterStarted := failFirstDeadLetter(t, b, 1500*time.Millisecond)
	small, err := kgopublisher.New(b.kafka.Brokers, &kgopublisher.Config{MaxRecordBytes: 4096})
	if err != nil {
		t.Fatal(err)
	}
	before := &recordingPublisher{Publisher: small}
	_, stop := b.startRelayWith(t, b.pool, before, relay.Config{InstanceID: "before"})
	waitFor(t, "the first dead-letter attempt", 30*time.Second, deadLetterStarted)
	stop()
	after := &recordingPublisher{Publisher: b.publisher(t)}
	b.startRelayWith(t, b.pool, after, relay.Config{InstanceID: "after"})
	waitFor(t, "the outbox to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	checkSettledInOrder(t, b, shortValues(firstPublications(append(before.ackedValues(), after.ackedValues()...))))
}

// incompressible returns prefix and n random bytes: no codec takes them
// under a limit.
func incompressible(prefix string, n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return append([]byte(prefix), b...)
}

// shortValues cuts values to their first word ("first", "second").
func shortValues(values []string) []string {
	for i, v := range values {
		if strings.HasPrefix(v, "first") {
			values[i] = "first"
		}
	}
	return values
}

// callCounter counts Publish calls.
type callCounter struct {
	relay.Publisher
	calls atomic.Int64
}

func (p *callCounter) Publish(ctx context.Context, records []relay.Record) []error {
	p.calls.Add(1)
	return p.Publisher.Publish(ctx, records)
}

// Holding a dead-lettered event's key back must not cost a round per
// event when the key's later events are refused for good as well: a
// key's events to a topic unknown past its grace are dead-lettered
// together, in the round that refuses them (one dead letter, one
// statement), not one a round.
func TestAKeysEventsRefusedForGoodAreDeadLetteredInOneRound(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 200
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = outbox.Message{Topic: "gone-" + b.schema, Key: []byte("K"), Value: []byte(fmt.Sprint(i))}
	}
	b.write(t, msgs...)
	if _, err := b.pool.Exec(context.Background(), `UPDATE `+pgx.Identifier{b.schema, "outbox"}.Sanitize()+
		` SET first_refused_at = now() - interval '1 hour', refused_kind = 1`); err != nil {
		t.Fatal(err)
	}
	pub := &callCounter{Publisher: b.publisher(t)}
	b.startRelayWith(t, b.pool, pub, relay.Config{})
	waitFor(t, "the dead letters", 30*time.Second, func() bool { return b.count(t, "outbox_dead") == n })
	if calls := pub.calls.Load(); calls > 3 {
		t.Fatalf("%d events of one key to a topic unknown past its grace took %d publish calls to dead-letter", n, calls)
	}
}

// Dead letters keep their key's order: a round's events dead-lettered
// together are listed, and replayed, in write order, also when the first
// one's row was rewritten (its retries) and lies after the others in the
// table (the statement that moves them reads it in table order). A
// replay that put a key's first event behind its later one would publish
// them out of order (G3).
func TestDeadLettersListAndReplayInWriteOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	missing := "missing-" + b.schema
	var msgs []outbox.Message
	for i := range 4 {
		msgs = append(msgs, outbox.Message{Topic: missing, Key: []byte("K"), Value: []byte(fmt.Sprint(i))})
	}
	b.write(t, msgs...)
	outboxT := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	// The first event's retries rewrote its row, past the others'.
	for range 3 {
		if _, err := b.pool.Exec(ctx, `UPDATE `+outboxT+` SET attempts = attempts + 1 WHERE value = '0'`); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := b.pool.Exec(ctx, `UPDATE `+outboxT+` SET first_refused_at = now() - interval '1 hour', refused_kind = 1`); err != nil {
		t.Fatal(err)
	}
	var physical []string
	rows, err := b.pool.Query(ctx, `SELECT convert_from(value, 'UTF8') FROM `+outboxT+` ORDER BY ctid`)
	if err != nil {
		t.Fatal(err)
	}
	if physical, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if physical[0] == "0" {
		t.Fatalf("table order %v: the first event's row is still first; the test proves nothing", physical)
	}
	_, stop := b.startRelay(t, relay.Config{})
	waitFor(t, "the dead letters", 30*time.Second, func() bool { return b.count(t, "outbox_dead") == len(msgs) })
	stop()
	dead, err := relay.ListDead(ctx, b.pool, b.schema, 10)
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, d := range dead {
		listed = append(listed, string(d.Value))
	}
	if !slices.Equal(listed, []string{"0", "1", "2", "3"}) {
		t.Fatalf("dead letters listed %v (table order %v), want write order", listed, physical)
	}
	b.kafka.CreateTopic(t, missing, 1, nil)
	if n, err := relay.ReplayDead(ctx, b.pool, b.schema, nil); err != nil || n != len(msgs) {
		t.Fatalf("replay: %d, %v", n, err)
	}
	rows, err = b.pool.Query(ctx, `SELECT convert_from(value, 'UTF8') FROM `+outboxT+` ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	replayed, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(replayed, []string{"0", "1", "2", "3"}) {
		t.Fatalf("replayed in id order %v, want write order", replayed)
	}
}

// batchWatch keeps the most failed events and sick partitions any round
// reported.
type batchWatch struct {
	mu           sync.Mutex
	failed, sick int
}

func (w *batchWatch) ObserveBatch(s relay.BatchStats) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.failed, w.sick = max(w.failed, s.Failed), max(w.sick, s.SickPartitions)
}

func (w *batchWatch) ObserveShards(int) {}

// A record near the client's size limit goes out, but the publisher holds
// its key's later records of the call (relay.ErrNotSent), in case the
// client refuses it. The relay reads them again in the next round: not
// failures, their partition not taken for sick, no backoff.
func TestARecordHeldBehindOneNearTheLimitGoesOutNext(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 1)
	b.write(t,
		outbox.Message{Topic: topic, Key: []byte("K"), Value: incompressible("first", 3925)},
		outbox.Message{Topic: topic, Key: []byte("K"), Value: []byte("second")},
		outbox.Message{Topic: topic, Key: []byte("K"), Value: []byte("third")},
		outbox.Message{Topic: topic, Key: []byte("other"), Value: []byte("other")},
	)
	pub, err := kgopublisher.New(b.kafka.Brokers, &kgopublisher.Config{MaxRecordBytes: 4096})
	if err != nil {
		t.Fatal(err)
	}
	rec := &recordingPublisher{Publisher: pub}
	watch := &batchWatch{}
	b.startRelayWith(t, b.pool, rec, relay.Config{Observer: watch})
	waitFor(t, "the outbox to drain", 10*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	first := slices.DeleteFunc(shortValues(firstPublications(rec.ackedValues())), func(v string) bool { return v == "other" })
	if !slices.Equal(first, []string{"first", "second", "third"}) {
		t.Fatalf("first published %v, want first, second, third", first)
	}
	watch.mu.Lock()
	defer watch.mu.Unlock()
	if watch.failed > 0 || watch.sick > 0 {
		t.Fatalf("a record held behind one near the limit counted as %d failed, %d sick partitions", watch.failed, watch.sick)
	}
	if rec.notSent.Load() == 0 {
		t.Fatal("the publisher never held the later record back; the test proves nothing")
	}
	if b.count(t, "outbox_dead") != 0 {
		t.Fatal("dead-lettered")
	}
}
