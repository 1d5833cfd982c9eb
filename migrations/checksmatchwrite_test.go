package migrations_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// checksMatchWriteVersion is the migration that makes the outbox's checks
// refuse what outbox.Write refuses.
const checksMatchWriteVersion = 8

// A plain-SQL producer gets at its INSERT what outbox.Write refuses: a
// topic name Kafka would refuse (which the relay could only dead-letter,
// after holding the key's later events on valid topics for the unknown-topic
// grace), and a message-id header, which the relay replaces with the
// event's event_id, so a producer that meant it as its own id would see
// every copy of an event get a new one (set the event_id column instead).
func TestPlainSQLGetsWhatWriteRefusesRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.EmptySchema(t)
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	insert := `INSERT INTO ` + outbox + ` (topic, headers) VALUES ($1, $2::jsonb)`
	for _, c := range []struct{ topic, headers string }{
		{"bad topic", `{}`},
		{"..", `{}`},
		{".", `{}`},
		{"café", `{}`},
		{"orders/eu", `{}`},
		{strings.Repeat("t", 250), `{}`},
		{"orders", `{"message-id": "6f1c1c3e-7f7a-4c1e-9a39-3b0c2d0e4a42"}`},
	} {
		_, err := pool.Exec(ctx, insert, c.topic, c.headers)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "23514" {
			t.Errorf("INSERT topic %.30q headers %s: %v, want a check violation (23514)", c.topic, c.headers, err)
		}
	}
	for _, c := range []struct{ topic, headers string }{
		{"orders", `{"Message-ID": "x", "trace": "y"}`},
		{"Orders_v2.eu-west-1", `{}`},
		{"...", `{}`},
		{strings.Repeat("t", 249), `{}`},
	} {
		if _, err := pool.Exec(ctx, insert, c.topic, c.headers); err != nil {
			t.Errorf("INSERT topic %.30q headers %s: %v, want it accepted", c.topic, c.headers, err)
		}
	}
}

// Rows the earlier checks let through are mended by migration 8 so the
// relay's own updates and a replay pass the new checks: a message-id header
// is dropped (the relay published the event id under that name anyway),
// and a pending event on a topic name Kafka refuses is dead-lettered, which
// is what the relay would have done with it.
func TestChecksMatchWriteMendTheRowsTheEarlierChecksLetThrough(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.EmptySchema(t)
	upTo(t, schema, checksMatchWriteVersion-1)
	outbox, dead := pgx.Identifier{schema, "outbox"}.Sanitize(), pgx.Identifier{schema, "outbox_dead"}.Sanitize()
	for _, stmt := range []string{
		`INSERT INTO ` + outbox + ` (topic, key, value, headers) VALUES
			('orders', 'k', 'first', '{"message-id": "mine", "trace": "t-1"}'),
			('bad topic', 'k', 'second', '{"message-id": "mine"}'),
			('orders', 'k', 'third', NULL)`,
		`INSERT INTO ` + dead + ` (outbox_id, event_id, topic, headers, created_at, error, attempts)
			VALUES (1, gen_random_uuid(), 't', '{"message-id": "x", "a": "b"}', now(), 'x', 1)`,
	} {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	rows, _ := pool.Query(ctx, `SELECT convert_from(value, 'UTF8') || ' ' || coalesce(headers::text, 'NULL') FROM `+outbox+` ORDER BY id`)
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{`first {"trace": "t-1"}`, `third NULL`}; !slices.Equal(got, want) {
		t.Fatalf("outbox after migration 8:\n got %q\nwant %q", got, want)
	}
	rows, _ = pool.Query(ctx, `SELECT topic || ' ' || coalesce(headers::text, 'NULL') || ' ' || (error LIKE '%topic name%')::text FROM `+dead+` ORDER BY id`)
	got, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{`t {"a": "b"} false`, `bad topic {} true`}; !slices.Equal(got, want) {
		t.Fatalf("outbox_dead after migration 8:\n got %q\nwant %q", got, want)
	}
	if _, err := pool.Exec(ctx, `UPDATE `+outbox+` SET attempts = attempts + 1`); err != nil {
		t.Fatalf("an update of the pending rows: %v", err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, headers) SELECT topic, headers FROM `+dead+` WHERE topic = 't'`); err != nil {
		t.Fatalf("a replay of the mended dead row: %v", err)
	}
}

// Migration 8's revert restores version 7's domain checks exactly.
func TestChecksMatchWriteRevertToVersion7Exactly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	ref := pgtest.EmptySchema(t)
	upTo(t, ref, checksMatchWriteVersion-1)
	schema := pgtest.EmptySchema(t)
	upTo(t, schema, checksMatchWriteVersion)
	if describeOutbox(t, schema) == describeOutbox(t, ref) {
		t.Fatal("migration 8 changed nothing describeOutbox shows")
	}
	if _, err := migrations.Down(ctx, pool, schema, 1); err != nil {
		t.Fatal(err)
	}
	if got, want := describeOutbox(t, schema), describeOutbox(t, ref); got != want {
		t.Fatalf("after reverting migration 8:\n%s\nwant version 7's:\n%s", got, want)
	}
}
