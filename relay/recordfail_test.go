package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// A round whose outcome could not be recorded (its deletes failed: a
// dropped connection, a statement timeout) is published again, also when
// no new event comes. Its ids stayed left out of every read after the
// record ended, until another round came along to clear them: in a quiet
// outbox the relay published nothing more, for as long as no one wrote.
func TestARoundNotRecordedIsPublishedAgainWithoutNewEvents(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 2)
	ctx := context.Background()
	seq := pgx.Identifier{b.schema, "deletes"}.Sanitize()
	fn := pgx.Identifier{b.schema, "fail_first_delete"}.Sanitize()
	// The first DELETE from the outbox fails (a sequence, so that the
	// failure's rollback does not undo the count).
	for _, sql := range []string{
		`CREATE SEQUENCE ` + seq,
		`CREATE FUNCTION ` + fn + `() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF nextval('` + seq + `') = 1 THEN
        RAISE EXCEPTION 'injected: the round''s record fails';
    END IF;
    RETURN NULL;
END $$`,
		`CREATE TRIGGER fail_first_delete BEFORE DELETE ON ` + pgx.Identifier{b.schema, "outbox"}.Sanitize() + `
    FOR EACH STATEMENT EXECUTE FUNCTION ` + fn + `()`,
	} {
		if _, err := b.pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	var msgs []outbox.Message
	for i := range 20 {
		msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint("k", i%5)), Value: []byte(fmt.Sprint(i))})
	}
	b.write(t, msgs...)
	b.startRelay(t, relay.Config{})
	waitFor(t, "the events whose record failed to be published again and deleted", 15*time.Second, func() bool {
		return b.count(t, "outbox") == 0
	})
	seen := map[string]bool{}
	for _, r := range b.kafka.ReadAll(t, topic, 40, 10*time.Second) {
		seen[messageID(r)] = true
	}
	if len(seen) != len(msgs) {
		t.Fatalf("%d distinct events in Kafka, want %d", len(seen), len(msgs))
	}
}
