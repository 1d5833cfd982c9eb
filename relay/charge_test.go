package relay_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// onceFailingPublisher fails every record of its first call with err; its
// later calls wait for their context to end, so that the first round's
// outcome is the only one recorded while the test looks.
type onceFailingPublisher struct {
	err   error
	calls chan struct{}
}

func newOnceFailingPublisher(err error) *onceFailingPublisher {
	return &onceFailingPublisher{err: err, calls: make(chan struct{}, 1)}
}

func (p *onceFailingPublisher) Publish(ctx context.Context, records []relay.Record) []error {
	err := p.err
	select {
	case p.calls <- struct{}{}:
	default:
		<-ctx.Done()
		err = ctx.Err()
	}
	errs := make([]error, len(records))
	for i := range errs {
		errs[i] = err
	}
	return errs
}

func (p *onceFailingPublisher) Close() error { return nil }

// chargeRow is what the round's outcome may have written on one event's
// row, and the row version it left.
type chargeRow struct {
	id          int64
	key         *string
	attempts    int
	lastError   *string
	refused     bool // first_refused_at set
	refusedKind *int16
	version     string // ctid and xmin: a new one if the row was rewritten
}

func (r chargeRow) String() string {
	deref := func(p any) string {
		switch v := p.(type) {
		case *string:
			if v != nil {
				return fmt.Sprintf("%q", *v)
			}
		case *int16:
			if v != nil {
				return fmt.Sprint(*v)
			}
		}
		return "NULL"
	}
	return fmt.Sprintf("{id %d key %s attempts %d last_error %s refused %t refused_kind %s version %s}",
		r.id, deref(r.key), r.attempts, deref(r.lastError), r.refused, deref(r.refusedKind), r.version)
}

func (b *bundle) chargeRows(t *testing.T) []chargeRow {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT id, convert_from(key, 'UTF8'), attempts, last_error,
    first_refused_at IS NOT NULL, refused_kind, ctid::text || '/' || xmin::text
FROM `+pgx.Identifier{b.schema, "outbox"}.Sanitize()+` ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (chargeRow, error) {
		var r chargeRow
		err := row.Scan(&r.id, &r.key, &r.attempts, &r.lastError, &r.refused, &r.refusedKind, &r.version)
		return r, err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// writeFailingRound writes keyed events of key K and then keyless events
// (topic "stuck"), puts K's third event in an unknown-topic run started 10
// s ago, and returns its id.
func (b *bundle) writeFailingRound(t *testing.T, keyed, keyless int) (inRun int64) {
	t.Helper()
	var msgs []outbox.Message
	for i := range keyed {
		msgs = append(msgs, outbox.Message{Topic: "stuck", Key: []byte("K"), Value: []byte(fmt.Sprint(i))})
	}
	for i := range keyless {
		msgs = append(msgs, outbox.Message{Topic: "stuck", Value: []byte(fmt.Sprint("keyless-", i))})
	}
	b.write(t, msgs...)
	table := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	if err := b.pool.QueryRow(context.Background(), `UPDATE `+table+` SET first_refused_at = now() - interval '10 seconds', refused_kind = 1
WHERE id = (SELECT id FROM `+table+` WHERE key = 'K' ORDER BY id OFFSET 2 LIMIT 1) RETURNING id`).Scan(&inRun); err != nil {
		t.Fatal(err)
	}
	return inRun
}

// A round in which a key's events fail with a passing error charges the
// key's first failed event only: only that one is retried (alone, its key
// held back behind it), and the charges on the later ones said nothing
// while their UPDATE rewrote a round of rows on the hot table (15-19 ms of
// PostgreSQL's CPU on the relay's path at 1,000). A later event's row is
// left as it was, unless a refusal run it carries must end, as any answer
// but that refusal ends it. Keyless events are each their own key.
func TestAFailedRoundChargesEachKeysFirstEventOnly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// K's third event carries an unknown-topic run from an earlier attempt.
	b.writeFailingRound(t, 5, 2)
	before := b.chargeRows(t)

	b.startRelayWith(t, b.pool, newOnceFailingPublisher(errNotEnoughReplicas), relay.Config{})
	waitFor(t, "the failed round's outcome", 30*time.Second, func() bool { return b.chargeRows(t)[0].attempts > 0 })
	after := b.chargeRows(t)

	charged := func(r chargeRow) bool {
		return r.attempts == 1 && r.lastError != nil && *r.lastError == errNotEnoughReplicas.Error() && !r.refused && r.refusedKind == nil
	}
	for i, r := range after {
		switch {
		case r.key == nil: // keyless: each is its key's first
			if !charged(r) {
				t.Errorf("keyless event %d: %v, want charged an attempt and its error", r.id, r)
			}
		case i == 0:
			if !charged(r) {
				t.Errorf("K's first event: %v, want charged an attempt and its error", r)
			}
		case i == 2:
			if r.attempts != 0 || r.lastError != nil || r.refused || r.refusedKind != nil {
				t.Errorf("K's third event: %v, want its unknown-topic run ended and no attempt charged", r)
			}
		default:
			if r.attempts != 0 || r.lastError != nil {
				t.Errorf("K's event %d: %v, want no attempt charged", i+1, r)
			}
			if r.version != before[i].version {
				t.Errorf("K's event %d: its row was rewritten (%s, was %s) though nothing of it changed", i+1, r.version, before[i].version)
			}
		}
	}
}

// Every event an unknown topic refuses keeps its own refusal run, the later
// events of a key too: the grace is counted per row, and a later event
// reaches the head of its key with its run already going.
func TestARefusedRoundStartsEveryEventsRefusalRun(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var msgs []outbox.Message
	for i := range 3 {
		msgs = append(msgs, outbox.Message{Topic: "missing", Key: []byte("K"), Value: []byte(fmt.Sprint(i))})
	}
	b.write(t, msgs...)
	ctx := context.Background()
	table := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	// K's last event carries a forbidden-topic run: another answer starts
	// its run again.
	if _, err := b.pool.Exec(ctx, `UPDATE `+table+` SET first_refused_at = now() - interval '1 hour', refused_kind = 2
WHERE id = (SELECT max(id) FROM `+table+`)`); err != nil {
		t.Fatal(err)
	}

	unknown := fmt.Errorf("%w: UNKNOWN_TOPIC_OR_PARTITION", relay.ErrUnknownTopic)
	b.startRelayWith(t, b.pool, newOnceFailingPublisher(unknown), relay.Config{})
	waitFor(t, "the refused round's outcome", 30*time.Second, func() bool { return b.chargeRows(t)[0].attempts > 0 })
	var fresh int
	if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM `+table+`
WHERE attempts = 1 AND last_error = $1 AND refused_kind = 1 AND first_refused_at > now() - interval '1 minute'`, unknown.Error()).Scan(&fresh); err != nil {
		t.Fatal(err)
	}
	if fresh != 3 {
		t.Fatalf("%d of K's 3 refused events were charged with an unknown-topic run started now, want 3: %v", fresh, b.chargeRows(t))
	}
}

// The failure statement names only the rows it writes: each key's first
// failed event, and a later one only while its row is in a refusal run that
// must end. It named every failed event, and PostgreSQL looked up each one
// by the primary key to write none of them: 1,000 lookups (3-8 ms on the
// relay's path) when a key with a backlog gets stuck.
func TestAFailedRoundNamesOnlyTheRowsItWrites(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// K's third event is in an unknown-topic run, which this answer ends.
	inRun := b.writeFailingRound(t, 50, 1)
	rows := b.chargeRows(t)
	want := []int64{rows[0].id, inRun, rows[len(rows)-1].id} // K's first, the one in a run, the keyless

	// The ids each failure statement (the UPDATE charging failed events)
	// names.
	var mu sync.Mutex
	var named [][]int64
	pool := pgtest.TracedPool(t, relay.StatementTracer{See: func(sql string, args []any) {
		if strings.Contains(sql, "SET last_error = CASE WHEN x.charge") {
			mu.Lock()
			named = append(named, slices.Clone(args[0].([]int64)))
			mu.Unlock()
		}
	}}, 0)
	b.startRelayWith(t, pool, newOnceFailingPublisher(errNotEnoughReplicas), relay.Config{})
	waitFor(t, "the failed round's outcome", 30*time.Second, func() bool { return b.chargeRows(t)[0].attempts > 0 })

	mu.Lock()
	defer mu.Unlock()
	if len(named) != 1 || !slices.Equal(named[0], want) {
		t.Fatalf("failure statements named %v, want one naming %v", named, want)
	}
	if r := b.chargeRows(t)[2]; r.refused || r.refusedKind != nil {
		t.Errorf("K's third event: %v, want its unknown-topic run ended", r)
	}
}
