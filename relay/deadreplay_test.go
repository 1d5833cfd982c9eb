package relay_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// deadRow is a dead letter written by hand: its key, value and outbox id.
type deadRow struct {
	key      any // nil: keyless
	value    string
	outboxID int64
}

// insertDead writes rows into outbox_dead and returns their ids by value.
func (b *bundle) insertDead(t *testing.T, rows ...deadRow) map[string]int64 {
	t.Helper()
	ids := map[string]int64{}
	for _, r := range rows {
		var id int64
		if err := b.pool.QueryRow(context.Background(), `INSERT INTO `+pgx.Identifier{b.schema, "outbox_dead"}.Sanitize()+
			` (outbox_id, event_id, topic, key, value, created_at, error, attempts) VALUES ($1, gen_random_uuid(), 'payments', $2::bytea, convert_to($3, 'UTF8'), now(), 'too large', 1)
			RETURNING id`, r.outboxID, r.key, r.value).Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids[r.value] = id
	}
	return ids
}

// pendingValues lists the outbox's values in id order, the order the relay
// publishes a key's events in.
func (b *bundle) pendingValues(t *testing.T) []string {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT convert_from(value, 'UTF8') FROM `+pgx.Identifier{b.schema, "outbox"}.Sanitize()+` ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	v, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// Replaying a key's later dead event while an earlier one of the same key
// stays dead would publish "refund 100" before "debit 100" (G3): the replay
// is refused, naming the earlier events, and moves nothing, unless the
// operator says the order does not matter. Other keys, keyless events and
// a replay that takes the earlier event along are not held.
func TestAReplayThatPutsAKeysLaterEventAheadOfAnEarlierDeadOneIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	ids := b.insertDead(t,
		deadRow{nil, "keyless", 9},
		deadRow{"acct-1", "debit 100", 10},
		deadRow{"acct-1", "refund 100", 11},
		deadRow{"acct-2", "other", 12},
		deadRow{"acct-3", "first", 13},
		deadRow{"acct-3", "second", 14},
	)
	n, err := relay.ReplayDead(ctx, b.pool, b.schema, []int64{ids["refund 100"], ids["other"]})
	var order *relay.DeadOutOfOrderError
	if !errors.As(err, &order) || n != 0 || !slices.Equal(order.IDs, []int64{ids["debit 100"]}) {
		t.Fatalf("replay of acct-1's later event alone: %d, %v; want nothing replayed and debit 100 (id %d) named", n, err, ids["debit 100"])
	}
	if got := b.count(t, "outbox_dead"); got != 6 {
		t.Fatalf("%d dead events left, want 6 (nothing replayed)", got)
	}
	for _, take := range [][]int64{{ids["keyless"]}, {ids["other"]}, {ids["refund 100"], ids["debit 100"]}} {
		if n, err := relay.ReplayDead(ctx, b.pool, b.schema, take); err != nil || n != len(take) {
			t.Fatalf("replay %v: %d, %v", take, n, err)
		}
	}
	if n, err := relay.ReplayDead(ctx, b.pool, b.schema, []int64{ids["second"]}, relay.ReplayOutOfOrder()); err != nil || n != 1 {
		t.Fatalf("replay of acct-3's later event, out of order on purpose: %d, %v", n, err)
	}
	if got, want := b.pendingValues(t), []string{"keyless", "other", "debit 100", "refund 100", "second"}; !slices.Equal(got, want) {
		t.Fatalf("outbox %q, want %q", got, want)
	}
}

// An event replayed alone that Kafka refuses again is dead a second time,
// with a new outbox id and a later dead_at than its key's later event that
// stayed dead. A replay of both must still put it first: write order is the
// event's first outbox id, kept across replays (G3).
func TestAReplayedEventThatDiesAgainKeepsItsPlaceInItsKeysOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	fake := b.kafka.RequireFake(t)
	topic := b.kafka.Topic(t, 1)
	refused := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.InvalidTopicException, Count: -1})
	b.write(t,
		outbox.Message{Topic: topic, Key: []byte("acct-1"), Value: []byte("debit 100")},
		outbox.Message{Topic: topic, Key: []byte("acct-1"), Value: []byte("refund 100")},
	)
	_, stop := b.startRelay(t, relay.Config{})
	waitFor(t, "both dead", 30*time.Second, func() bool { return b.count(t, "outbox_dead") == 2 })
	dead, err := relay.ListDead(ctx, b.pool, b.schema, 10)
	if err != nil || len(dead) != 2 || string(dead[0].Value) != "debit 100" {
		t.Fatalf("dead letters %+v, %v", dead, err)
	}
	// The operator replays the first one to try a fix; Kafka refuses it again.
	if n, err := relay.ReplayDead(ctx, b.pool, b.schema, []int64{dead[0].ID}); err != nil || n != 1 {
		t.Fatalf("replay of debit 100: %d, %v", n, err)
	}
	waitFor(t, "debit 100 dead again", 30*time.Second, func() bool { return b.count(t, "outbox_dead") == 2 })
	stop()
	refused.Remove()
	if n, err := relay.ReplayDead(ctx, b.pool, b.schema, nil); err != nil || n != 2 {
		t.Fatalf("replay of all: %d, %v", n, err)
	}
	if got, want := b.pendingValues(t), []string{"debit 100", "refund 100"}; !slices.Equal(got, want) {
		t.Fatalf("acct-1 queued as %q, want its write order %q", got, want)
	}
}

// During a rolling upgrade a relay of the previous release dead-letters
// with its own statement, which knows nothing of migration 9. A replayed
// event it dead-letters again must still keep its place in its key's
// order: the first outbox id is recorded by event_id at the replay, not
// carried by the relay.
func TestAnEventDeadLetteredByThePreviousReleasesRelayKeepsItsPlace(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	outboxT := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	deadT := pgx.Identifier{b.schema, "outbox_dead"}.Sanitize()
	ids := b.insertDead(t, deadRow{"acct-1", "debit 100", 10}, deadRow{"acct-1", "refund 100", 11})
	if _, err := b.pool.Exec(ctx, `ALTER TABLE `+outboxT+` ALTER COLUMN id RESTART WITH 100`); err != nil {
		t.Fatal(err)
	}
	if n, err := relay.ReplayDead(ctx, b.pool, b.schema, []int64{ids["debit 100"]}); err != nil || n != 1 {
		t.Fatalf("replay of debit 100: %d, %v", n, err)
	}
	// The previous release's dead-letter statement (01d3295's relay/store.go,
	// without its ownership condition).
	if _, err := b.pool.Exec(ctx, `WITH moved AS (
    DELETE FROM `+outboxT+` o USING unnest((SELECT array_agg(id) FROM `+outboxT+`), ARRAY['too large']) AS x(id, error)
    WHERE o.id = x.id
    RETURNING o.id, o.event_id, o.topic, o.key, o.value, o.headers, o.created_at, o.attempts, x.error)
INSERT INTO `+deadT+` (outbox_id, event_id, topic, key, value, headers, created_at, attempts, error)
SELECT id, event_id, topic, key, value, headers, created_at, attempts + 1, error FROM moved ORDER BY id`); err != nil {
		t.Fatal(err)
	}
	list, err := relay.ListDead(ctx, b.pool, b.schema, 10)
	if err != nil || len(list) != 2 || string(list[0].Value) != "debit 100" {
		t.Fatalf("dead letters %+v, %v; want debit 100 listed first (write order)", list, err)
	}
	_, err = relay.ReplayDead(ctx, b.pool, b.schema, []int64{ids["refund 100"]})
	var order *relay.DeadOutOfOrderError
	if !errors.As(err, &order) {
		t.Fatalf("replay of refund 100 alone while debit 100 stays dead: %v; want a DeadOutOfOrderError", err)
	}
	if n, err := relay.ReplayDead(ctx, b.pool, b.schema, nil); err != nil || n != 2 {
		t.Fatalf("replay of all: %d, %v", n, err)
	}
	if got, want := b.pendingValues(t), []string{"debit 100", "refund 100"}; !slices.Equal(got, want) {
		t.Fatalf("acct-1 queued as %q, want its write order %q", got, want)
	}
}

// Migration 8 dead-letters pending events on topic names Kafka refuses, and
// they cannot go back into the outbox. A replay that takes one in fails
// naming it, replays nothing and is no bare check violation; one that
// leaves it out goes on.
func TestADeadEventOnARefusedTopicNameIsNamedNotABareCheckViolation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	var bad int64
	if err := b.pool.QueryRow(ctx, `INSERT INTO `+pgx.Identifier{b.schema, "outbox_dead"}.Sanitize()+` (outbox_id, event_id, topic, key, value, created_at, error, attempts)
		VALUES (9, gen_random_uuid(), 'bad topic', 'acct-1', 'x', now(), 'topic name Kafka refuses', 0) RETURNING id`).Scan(&bad); err != nil {
		t.Fatal(err)
	}
	ids := b.insertDead(t, deadRow{"acct-2", "other key", 10})
	n, err := relay.ReplayDead(ctx, b.pool, b.schema, nil)
	var unfit *relay.DeadUnreplayableError
	if !errors.As(err, &unfit) || n != 0 || !slices.Equal(unfit.IDs, []int64{bad}) {
		t.Fatalf("replay of all beside dead letter %d on a refused topic name: %d, %v; want nothing replayed and %d named", bad, n, err, bad)
	}
	if n, err := relay.ReplayDead(ctx, b.pool, b.schema, []int64{ids["other key"]}); err != nil || n != 1 {
		t.Fatalf("replay of the other key's event: %d, %v", n, err)
	}
	if dead, err := relay.DiscardDead(ctx, b.pool, b.schema, []int64{bad}); err != nil || len(dead) != 1 {
		t.Fatalf("discard of %d: %v, %v", bad, dead, err)
	}
}

// deadValues lists the dead events' values as ListDead orders them, and
// their ids by value.
func (b *bundle) deadValues(t *testing.T) ([]string, map[string]int64) {
	t.Helper()
	dead, err := relay.ListDead(context.Background(), b.pool, b.schema, 100)
	if err != nil {
		t.Fatal(err)
	}
	var v []string
	ids := map[string]int64{}
	for _, d := range dead {
		v = append(v, string(d.Value))
		ids[string(d.Value)] = d.ID
	}
	return v, ids
}

// One event id on two topics is one event fanned out (outbox.Message.ID),
// each copy in its own key order on its topic. Replaying one copy must not
// move the other ahead of its key's earlier events, and discarding one
// must not make the other, replayed and dead again, lose its place (a
// cold review's two cases).
func TestTheCopiesOfAFannedOutEventKeepTheirOwnPlaces(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	fake := b.kafka.RequireFake(t)
	topicA, topicB := b.kafka.Topic(t, 1), b.kafka.Topic(t, 1)
	fa := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topicA, Err: kerr.InvalidTopicException, Count: -1})
	fb := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topicB, Err: kerr.InvalidTopicException, Count: -1})
	const id = "7d3a1c52-3f0e-4a57-9f6e-2b1f8c9d0e11"
	k := []byte("acct-1")
	b.write(t,
		outbox.Message{ID: id, Topic: topicA, Key: k, Value: []byte("debit 100")},
		outbox.Message{Topic: topicB, Key: k, Value: []byte("audit first")},
		outbox.Message{ID: id, Topic: topicB, Key: k, Value: []byte("audit of debit 100")},
		outbox.Message{Topic: topicA, Key: k, Value: []byte("refund 100")},
	)
	_, stop := b.startRelay(t, relay.Config{})
	waitFor(t, "all dead", 30*time.Second, func() bool { return b.count(t, "outbox_dead") == 4 })
	stop()
	_, ids := b.deadValues(t)
	if n, err := relay.ReplayDead(ctx, b.pool, b.schema, []int64{ids["debit 100"]}); err != nil || n != 1 {
		t.Fatalf("replay of debit 100: %d, %v", n, err)
	}
	if got, want := b.deadValuesOnly(t), []string{"audit first", "audit of debit 100", "refund 100"}; !slices.Equal(got, want) {
		t.Fatalf("dead letters %q after replaying the other copy, want write order %q", got, want)
	}
	_, err := relay.ReplayDead(ctx, b.pool, b.schema, []int64{ids["audit of debit 100"]})
	var order *relay.DeadOutOfOrderError
	if !errors.As(err, &order) || !slices.Equal(order.IDs, []int64{ids["audit first"]}) {
		t.Fatalf("replay of topic B's later copy alone: %v; want a DeadOutOfOrderError naming audit first", err)
	}
	if _, err := relay.DiscardDead(ctx, b.pool, b.schema, []int64{ids["audit of debit 100"]}); err != nil {
		t.Fatal(err)
	}
	// Kafka refuses debit 100 again.
	_, stop = b.startRelay(t, relay.Config{})
	waitFor(t, "debit 100 dead again", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 && b.count(t, "outbox_dead") == 3 })
	stop()
	fa.Remove()
	fb.Remove()
	got, ids := b.deadValues(t)
	if want := []string{"debit 100", "audit first", "refund 100"}; !slices.Equal(got, want) {
		t.Fatalf("dead letters %q, want write order %q", got, want)
	}
	// The key's order spans its topics: audit first is held too.
	held := []int64{ids["audit first"], ids["debit 100"]}
	slices.Sort(held)
	if _, err := relay.ReplayDead(ctx, b.pool, b.schema, []int64{ids["refund 100"]}); !errors.As(err, &order) || !slices.Equal(order.IDs, held) {
		t.Fatalf("replay of refund 100 alone while debit 100 stays dead: %v; want a DeadOutOfOrderError naming %v", err, held)
	}
}

func (b *bundle) deadValuesOnly(t *testing.T) []string {
	t.Helper()
	v, _ := b.deadValues(t)
	return v
}
