package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

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
	if err == nil || !strings.Contains(err.Error(), "dead events 1 come first") || !strings.Contains(err.Error(), "--out-of-order") {
		t.Fatalf("replay of the key's later event alone: err %v, want it refused naming 1\n%s", err, out)
	}
	if n := count(t, schema, "outbox_dead"); n != 2 {
		t.Fatalf("%d dead events left, want 2 (none replayed)", n)
	}
	if out, err := runCLI(t, append([]string{"dead", "replay", "--ids", "2", "--out-of-order"}, flags...)...); err != nil || !strings.Contains(out, "replayed 1 dead events") {
		t.Fatalf("--out-of-order: %v\n%s", err, out)
	}
}

// dead discard that loses a race for one of its ids (another transaction
// deleted it and commits while the discard waits for its row) discards
// nothing: the CLI's transaction rolls back. The error said "(discarded
// 1)", counting the other id's delete that the rollback undid.
func TestDeadDiscardThatLosesARaceSaysNothingWasDiscarded(t *testing.T) {
	t.Parallel()
	schema, flags := deadSetup(t, 2)
	got := loseARaceForID1(t, schema, flags, "discard")
	if got.err == nil || !strings.Contains(got.err.Error(), "ids 1 ") || strings.Contains(got.err.Error(), "discarded 1") ||
		!strings.Contains(got.err.Error(), "nothing was discarded") {
		t.Fatalf("discard --ids 1,2 losing id 1: err %v, want one naming id 1 and saying nothing was discarded\n%s", got.err, got.out)
	}
	if strings.Contains(got.out, "discarded 1") {
		t.Fatalf("the output says an event was discarded:\n%s", got.out)
	}
	if n := count(t, schema, "outbox_dead"); n != 1 {
		t.Fatalf("%d dead events left, want 1 (event 2 still dead)", n)
	}
}

// raceResult is what a dead command printed and returned.
type raceResult struct {
	out string
	err error
}

// loseARaceForID1 runs "dead <verb> --ids 1,2" while another session has
// deleted dead event 1 and not committed, commits that once the command
// waits for the row, and returns what the command did.
func loseARaceForID1(t *testing.T, schema string, flags []string, verb string) raceResult {
	t.Helper()
	ctx := context.Background()
	other, err := pgtest.Conn(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback(ctx) }()
	dead := pgx.Identifier{schema, "outbox_dead"}.Sanitize()
	if _, err := other.Exec(ctx, `DELETE FROM `+dead+` WHERE id = 1`); err != nil {
		t.Fatal(err)
	}
	done := make(chan raceResult, 1)
	go func() {
		out, err := runCLI(t, append([]string{"dead", verb, "--ids", "1,2"}, flags...)...)
		done <- raceResult{out, err}
	}()
	waitUntil(t, "the "+verb+" to wait for the other's row", 10*time.Second, func() bool {
		var waiting bool
		_ = pgtest.Pool(t).QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND strpos(query, $1) > 0)`,
			dead).Scan(&waiting)
		return waiting
	})
	if err := other.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return <-done
}

// dead list --limit says when it cuts the list: the first N of more looked
// like all of them.
func TestDeadListSaysWhenTheLimitCutsIt(t *testing.T) {
	t.Parallel()
	_, flags := deadSetup(t, 3)
	out, err := runCLI(t, append([]string{"dead", "list", "--limit", "2"}, flags...)...)
	if err != nil || strings.Count(out, "  event ") != 2 || !strings.Contains(out, "showing 2 of 3 dead events") {
		t.Fatalf("dead list --limit 2 of 3: %v\n%s", err, out)
	}
	for _, limit := range []string{"3", "4"} {
		out, err := runCLI(t, append([]string{"dead", "list", "--limit", limit}, flags...)...)
		if err != nil || strings.Count(out, "  event ") != 3 || strings.Contains(out, "showing") {
			t.Fatalf("dead list --limit %s of 3: %v\n%s", limit, err, out)
		}
	}
	// --json keeps stdout one JSON array: the note goes to stderr.
	var stdout, stderr bytes.Buffer
	if err := run(context.Background(), append([]string{"dead", "list", "--json", "--limit", "2"}, flags...), &stdout, &stderr); err != nil {
		t.Fatal(err)
	}
	var dead []deadJSON
	if err := json.Unmarshal(stdout.Bytes(), &dead); err != nil || len(dead) != 2 || !strings.Contains(stderr.String(), "showing 2 of 3 dead events") {
		t.Fatalf("dead list --json --limit 2 of 3: %v, %d events\nstdout: %s\nstderr: %s", err, len(dead), stdout.String(), stderr.String())
	}
}
