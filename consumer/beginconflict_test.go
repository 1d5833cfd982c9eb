package consumer_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

// A serialization failure or deadlock at the dedup record's insert (BEGIN's
// own statement: under SERIALIZABLE, another delivery of the same message
// inserting it at once) is waited out without spending a budget, as a
// database that cannot begin is; but it was logged as "database
// unavailable", sending an operator after an outage that was not there.
// It is logged as the conflict it is, and RetryEvent.Conflict says so.
func TestAConflictAtTheDedupInsertIsLoggedAsAConflict(t *testing.T) {
	inBothModes(t, func(t *testing.T, batch bool) {
		b := setup(t)
		ctx := context.Background()
		q := func(name string) string { return pgx.Identifier{b.schema, name}.Sanitize() }
		for _, s := range []string{
			`CREATE SEQUENCE ` + q("dedup_inserts"),
			`CREATE FUNCTION ` + q("conflict_twice") + `() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF nextval('` + q("dedup_inserts") + `') <= 2 THEN
        RAISE EXCEPTION 'injected: could not serialize access' USING ERRCODE = '40001';
    END IF;
    RETURN NEW;
END $$`,
			`CREATE TRIGGER conflict_twice BEFORE INSERT ON ` + q("processed_messages") + ` FOR EACH ROW EXECUTE FUNCTION ` + q("conflict_twice") + `()`,
		} {
			if _, err := b.pool.Exec(ctx, s); err != nil {
				t.Fatal(err)
			}
		}
		logs := &syncBuffer{}
		retries := &retryRecorder{}
		p := newLedgerProcessor(t, b.pool, batch, func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
			return b.record(ctx, tx, "ledger", m)
		}, &consumer.Config{Schema: b.schema, MinBackoff: time.Millisecond, MaxBackoff: 2 * time.Millisecond,
			Hooks: []consumer.Hook{retries}, Logger: slog.New(slog.NewTextHandler(logs, nil))})
		tr := &memTransport{}
		run(t, p, tr, msg(0, "m-0", ""))
		if n := b.count(t, "message_id = $1", "m-0"); n != 1 || len(tr.deadLetters()) != 0 {
			t.Fatalf("effects of m-0: %d, dead letters %d: want 1 and 0", n, len(tr.deadLetters()))
		}
		out := logs.String()
		if strings.Contains(out, "database unavailable") {
			t.Errorf("a serialization failure at the dedup insert was logged as an outage:\n%s", out)
		}
		if !strings.Contains(out, "serialization failure or deadlock") {
			t.Errorf("no line names the conflict:\n%s", out)
		}
		for _, e := range retries.get() {
			if !e.Conflict {
				t.Errorf("RetryEvent.Conflict false for %v", e.Err)
			}
		}
	})
}
