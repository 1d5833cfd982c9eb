package relay_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// recordingPublisher passes records to a real publisher and notes the
// values it acknowledged, in the order their calls returned.
type recordingPublisher struct {
	relay.Publisher
	mu    sync.Mutex
	acked []string
}

func (p *recordingPublisher) Publish(ctx context.Context, records []relay.Record) []error {
	errs := p.Publisher.Publish(ctx, records)
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, err := range errs {
		if err == nil {
			p.acked = append(p.acked, string(records[i].Value))
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
	q := func(name string) string { return pgx.Identifier{b.schema, name}.Sanitize() }
	for _, s := range []string{
		// The first event's topic has been unknown for an hour: its grace
		// (a minute) is over when the relay first tries it.
		`UPDATE ` + q("outbox") + ` SET first_refused_at = now() - interval '1 hour', refused_kind = 1 WHERE value = 'first'`,
		// A sequence counts the dead-letter attempts across the failed
		// transactions; the first one hangs for a while, then fails.
		`CREATE SEQUENCE ` + q("dead_letter_attempts"),
		`CREATE FUNCTION ` + q("fail_first_dead_letter") + `() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF nextval('` + q("dead_letter_attempts") + `') = 1 THEN
        PERFORM pg_sleep(1.5);
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
	pub := &recordingPublisher{Publisher: b.publisher(t)}
	b.startRelayWith(t, b.pool, pub, relay.Config{BatchSize: batch})

	waitFor(t, "the first dead-letter attempt", 30*time.Second, func() bool {
		var called bool
		if err := b.pool.QueryRow(ctx, `SELECT is_called FROM `+q("dead_letter_attempts")).Scan(&called); err != nil {
			t.Fatal(err)
		}
		return called
	})
	b.kafka.CreateTopic(t, missing, 1, nil) // while the dead-letter hangs
	waitFor(t, "the outbox to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })

	acked := slices.DeleteFunc(firstPublications(pub.ackedValues()), func(v string) bool { return v == "other" })
	dead := b.count(t, "outbox_dead")
	t.Logf("first publications %v, dead-lettered %d", acked, dead)
	switch {
	case slices.Equal(acked, []string{"first", "second"}) && dead == 0:
		// The dead-letter failed, and the topic was there on the retry.
	case slices.Equal(acked, []string{"second"}) && dead == 1:
		// The retry still found the topic unknown and dead-lettered it.
	default:
		t.Fatalf("first published %v with %d dead-lettered: the key's later event went out before its first event was settled", acked, dead)
	}
}
