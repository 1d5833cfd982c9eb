package main

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// deadSetup returns a migrated schema holding n dead events and the flags
// that point the CLI at it.
func deadSetup(t *testing.T, n int) (schema string, flags []string) {
	t.Helper()
	schema = pgtest.Schema(t)
	for range n {
		_, err := pgtest.Pool(t).Exec(context.Background(), `INSERT INTO `+pgx.Identifier{schema, "outbox_dead"}.Sanitize()+
			` (outbox_id, event_id, topic, key, value, created_at, error, attempts) VALUES (1, gen_random_uuid(), 'gone', 'k', 'v', now(), 'unknown topic', 3)`)
		if err != nil {
			t.Fatal(err)
		}
	}
	return schema, []string{"--database-url", pgtest.URL(t), "--schema", schema}
}

// A blank --ids is a usage error, never "all": only --all means all.
func TestDeadReplayBlankIDsIsAUsageError(t *testing.T) {
	t.Parallel()
	schema, flags := deadSetup(t, 2)
	for _, ids := range []string{" ", ",", " , ,"} {
		out, err := runCLI(t, append([]string{"dead", "replay", "--ids", ids}, flags...)...)
		if !errors.Is(err, errUsage) {
			t.Errorf("--ids %q: err %v, want a usage error\n%s", ids, err, out)
		}
	}
	if n := count(t, schema, "outbox_dead"); n != 2 {
		t.Fatalf("%d dead events left, want 2 (none replayed)", n)
	}
}

// Ids that are not dead events are named, the command fails and nothing
// is replayed.
func TestDeadReplayUnknownIDsFails(t *testing.T) {
	t.Parallel()
	schema, flags := deadSetup(t, 1)
	for _, ids := range []string{"999", "1,999,998"} {
		out, err := runCLI(t, append([]string{"dead", "replay", "--ids", ids}, flags...)...)
		if err == nil || errors.Is(err, errUsage) || !strings.Contains(err.Error(), "999") || !strings.Contains(err.Error(), "998") && ids != "999" {
			t.Errorf("--ids %s: err %v, want a failure naming the missing ids\n%s", ids, err, out)
		}
	}
	if n := count(t, schema, "outbox_dead"); n != 1 {
		t.Fatalf("%d dead events left, want 1 (none replayed)", n)
	}
	if out, err := runCLI(t, append([]string{"dead", "replay", "--ids", "1"}, flags...)...); err != nil || !strings.Contains(out, "replayed 1") {
		t.Fatalf("--ids 1: %v\n%s", err, out)
	}
}

// A replay that would publish a key's later event before an earlier one
// that stays dead fails naming the earlier one and replays nothing;
// --out-of-order replays it anyway.
func TestDeadReplayKeepsAKeysOrderUnlessToldNot(t *testing.T) {
	t.Parallel()
	schema, flags := deadSetup(t, 2) // two dead events of key "k", ids 1 and 2
	out, err := runCLI(t, append([]string{"dead", "replay", "--ids", "2"}, flags...)...)
	if err == nil || !strings.Contains(err.Error(), "dead events 1 come first") {
		t.Fatalf("replay of the key's later event alone: err %v, want it refused naming 1\n%s", err, out)
	}
	if n := count(t, schema, "outbox_dead"); n != 2 {
		t.Fatalf("%d dead events left, want 2 (none replayed)", n)
	}
	if out, err := runCLI(t, append([]string{"dead", "replay", "--ids", "2", "--out-of-order"}, flags...)...); err != nil || !strings.Contains(out, "replayed 1 dead events") {
		t.Fatalf("--out-of-order: %v\n%s", err, out)
	}
}
