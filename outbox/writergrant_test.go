package outbox_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
)

// README's writer grant: INSERT on the five columns a writer sets, so that
// a writer cannot also set the relay's own columns (attempts,
// first_refused_at, refused_kind, created_at). Both outbox.Write and the
// plain SQL of README's example must work under it.
func TestTheWritersColumnGrantIsEnough(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := pgtest.Schema(t)
	writer := pgtest.RolePool(t, schema,
		`GRANT USAGE ON SCHEMA {s} TO {role}`,
		`GRANT INSERT (event_id, topic, key, value, headers) ON {s}.outbox TO {role}`)
	w, err := outbox.NewWriter(&outbox.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, writer, func(tx pgx.Tx) error {
		return w.Write(ctx, tx,
			outbox.Message{Topic: "orders", Key: []byte("k1"), Value: []byte("v1"), Headers: map[string]string{"type": "created"}},
			outbox.Message{Topic: "orders", ID: "6f1b0c2e-6a43-4d53-9a55-1f0f2b7f2a11", Key: []byte("k1"), Value: []byte("v2")})
	})
	if err != nil {
		t.Fatalf("outbox.Write under the column grant: %v", err)
	}
	table := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := writer.Exec(ctx, `INSERT INTO `+table+` (topic, key, value, headers) VALUES ('orders', convert_to('k2', 'UTF8'), convert_to('{"id":"o-1"}', 'UTF8'), '{"type":"created"}')`); err != nil {
		t.Fatalf("README's plain SQL under the column grant: %v", err)
	}
	if _, err := writer.Exec(ctx, `INSERT INTO `+table+` (topic, attempts) VALUES ('orders', 7)`); err == nil {
		t.Fatal("the column grant let a writer set attempts")
	}
	got := readOutbox(t, pgtest.Pool(t), schema)
	if len(got) != 3 || string(got[0].value) != "v1" || string(got[1].value) != "v2" || got[2].key == nil || got[1].eventID != "6f1b0c2e-6a43-4d53-9a55-1f0f2b7f2a11" {
		t.Fatalf("rows %+v", got)
	}
}
