package main

// Operator misuse a cold review (helper 57) found: each test failed on the code
// before its fix.

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

// An operator rolls back the last release's migrations and forward again
// (`migrate down --steps 3`, `migrate up`): nothing in the data tables is
// dropped, so no --force is asked for. But migration 9's revert drops
// dead_replays, the only record of where a replayed-and-dead-again event
// stands in its key's write order. Afterwards the key's dead events list and
// replay out of order, and replaying the later one alone is no longer
// refused: G3 broken by a command that reported success.
func TestMigrateDownUpKeepsDeadEventsInWriteOrder(t *testing.T) {
	ctx := context.Background()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	flags := []string{"--database-url", pgtest.URL(t), "--schema", schema}
	q := func(sql string) {
		t.Helper()
		if _, err := pool.Exec(ctx, strings.ReplaceAll(sql, "S.", pgx.Identifier{schema}.Sanitize()+".")); err != nil {
			t.Fatal(err)
		}
	}
	// Key k: E1 written first (outbox id 10), E2 after it (11); both dead.
	// The outbox has handed out ids up to 1000 meanwhile.
	q(`SELECT setval(pg_get_serial_sequence('S.outbox', 'id'), 1000)`)
	q(`INSERT INTO S.outbox_dead (outbox_id, event_id, topic, key, value, created_at, error, attempts)
	   VALUES (10, 'aaaaaaaa-0000-0000-0000-000000000001', 'gone', 'k', 'E1', now(), 'unknown topic', 3),
	          (11, 'aaaaaaaa-0000-0000-0000-000000000002', 'gone', 'k', 'E2', now(), 'unknown topic', 3)`)
	// Replay E1 (allowed: it is the key's first); Kafka refuses it again and
	// the relay dead-letters it with its new outbox id (as store.go's deadSQL).
	if out, err := runCLI(t, append([]string{"dead", "replay", "--ids", "1"}, flags...)...); err != nil {
		t.Fatalf("replay E1: %v\n%s", err, out)
	}
	q(`WITH moved AS (DELETE FROM S.outbox RETURNING id, event_id, topic, key, value, headers, created_at, attempts)
	   INSERT INTO S.outbox_dead (outbox_id, event_id, topic, key, value, headers, created_at, attempts, error)
	   SELECT id, event_id, topic, key, value, headers, created_at, attempts + 1, 'unknown topic' FROM moved`)
	order := func() []string {
		t.Helper()
		out, err := runCLI(t, append([]string{"dead", "list", "--json"}, flags...)...)
		if err != nil {
			t.Fatalf("dead list: %v\n%s", err, out)
		}
		var dead []deadJSON
		if err := json.NewDecoder(strings.NewReader(out)).Decode(&dead); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		var vs []string
		for _, d := range dead {
			vs = append(vs, string(d.ValueBase64))
		}
		return vs
	}
	if got := strings.Join(order(), ","); got != "E1,E2" {
		t.Fatalf("before the down/up: dead list order %s, want E1,E2", got)
	}
	down, downErr := runCLI(t, append([]string{"migrate", "down", "--steps", "3"}, flags...)...)
	if up, err := runCLI(t, append([]string{"migrate", "up"}, flags...)...); err != nil {
		t.Fatalf("migrate up: %v\n%s", err, up)
	}
	if got := strings.Join(order(), ","); got != "E1,E2" {
		t.Errorf("migrate down --steps 3 (err %v: %q) then up: dead list order %s, want E1,E2 (the key's write order)", downErr, strings.TrimSpace(down), got)
	}
	// Replaying E2 alone would publish it before E1: it must be refused.
	out, err := runCLI(t, append([]string{"dead", "replay", "--ids", "2"}, flags...)...)
	if err == nil {
		var first string
		_ = pool.QueryRow(ctx, `SELECT convert_from(value, 'UTF8') FROM `+pgx.Identifier{schema, "outbox"}.Sanitize()+` ORDER BY id LIMIT 1`).Scan(&first)
		t.Errorf("dead replay --ids 2 (E2) while the earlier E1 stays dead: succeeded (%q), outbox now publishes %s first", strings.TrimSpace(out), first)
	}
}

// runCLITimeout is runCLI with a deadline, for commands that may run on.
func runCLITimeout(t *testing.T, d time.Duration, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var out bytes.Buffer
	err := run(ctx, args, &out, &out)
	return out.String(), err
}

// A broker address whose port is not a port is bad input (exit 2, one
// line naming --brokers), not a relay that starts and waits forever for a
// broker it can never dial, nor an exit 1 worded by the client library.
func TestRelayRefusesBrokerWithBadPort(t *testing.T) {
	url := pgtest.URL(t)
	schema := pgtest.Schema(t)
	for _, pub := range []string{"franz-go", "kafka-go"} {
		for _, b := range []string{"localhost:abc", "localhost:99999", "localhost:-1", "localhost: 9092"} {
			out, err := runCLITimeout(t, 3*time.Second, "relay", "--database-url", url, "--schema", schema,
				"--publisher", pub, "--brokers", b, "--log-level", "error", "--wait-for-database=false")
			if !errors.Is(err, errUsage) || !strings.Contains(err.Error(), "--brokers") {
				t.Errorf("%s --brokers %q: err %v, want a usage error naming --brokers\n%s", pub, b, err, firstLine(out))
			}
		}
	}
}

func firstLine(s string) string { l, _, _ := strings.Cut(s, "\n"); return l }

// A bound the relay's Config enforces is reported with the flag the
// operator typed, as every other bad flag is, not as a Go field.
func TestRelayBoundErrorsNameTheFlag(t *testing.T) {
	url := pgtest.URL(t)
	for flag, v := range map[string]string{"--batch-size": "200000", "--lease-duration": "100ms", "--poll-interval": "100us", "--probe-interval": "1us"} {
		_, err := runCLITimeout(t, 3*time.Second, "relay", "--database-url", url, "--brokers", "127.0.0.1:1", flag, v)
		if !errors.Is(err, errUsage) || !strings.Contains(err.Error(), flag) {
			t.Errorf("%s %s: err %v, want a usage error naming %s", flag, v, err, flag)
		}
	}
	// A bound between two flags names both.
	_, err := runCLITimeout(t, 3*time.Second, "relay", "--database-url", url, "--brokers", "127.0.0.1:1", "--kafka-handoff", "1s")
	if !errors.Is(err, errUsage) || !strings.Contains(err.Error(), "--kafka-handoff must be at least --lease-duration (6s)") {
		t.Errorf("--kafka-handoff 1s: err %v, want a usage error naming --kafka-handoff and --lease-duration", err)
	}
}

// "A flag given on the command line wins over its variable" (README): a
// malformed number in the environment stops the relay even when the flag
// that replaces it is given (a malformed text setting does not).
func TestFlagWinsOverBadEnvironmentNumber(t *testing.T) {
	t.Setenv("ONCEFLOW_BATCH_SIZE", "1k")
	envErrs = nil
	defer func() { envErrs = nil }()
	_, err := runCLITimeout(t, 2*time.Second, "relay", "--database-url", pgtest.URL(t), "--schema", "nosuchschema_operator",
		"--brokers", "127.0.0.1:1", "--batch-size", "10", "--wait-for-database=false", "--log-level", "error")
	if errors.Is(err, errUsage) && strings.Contains(err.Error(), "ONCEFLOW_BATCH_SIZE") {
		t.Errorf("--batch-size 10 with ONCEFLOW_BATCH_SIZE=1k: %v (the flag should win, as --log-level does over ONCEFLOW_LOG_LEVEL)", err)
	}
}

// --ids given twice: the flag package keeps the last, so the command acts
// on half the ids asked for and reports success.
func TestDeadDiscardIDsGivenTwice(t *testing.T) {
	schema, flags := deadSetup(t, 2)
	out, err := runCLI(t, append([]string{"dead", "discard", "--ids", "1", "--ids", "2"}, flags...)...)
	if err == nil && count(t, schema, "outbox_dead") != 0 {
		t.Errorf("dead discard --ids 1 --ids 2: exit 0, %d dead events left (id 1 kept), output:\n%s", count(t, schema, "outbox_dead"), firstLine(out))
	}
}

// dead replay that loses a race for one of its ids (another terminal's
// replay or discard of it commits while this one waits for the row) exits
// 1 "no dead events with ids 1", yet has replayed and committed the other
// ids: the help says "If an id is not a dead event, nothing is replayed".
// dead discard rolls back in the same race (TestDeadDiscardThatLosesARace...).
func TestDeadReplayThatLosesARaceReplaysNothing(t *testing.T) {
	schema, flags := deadSetup(t, 2)
	got := loseARaceForID1(t, schema, flags, "replay")
	if got.err == nil {
		t.Fatalf("replay --ids 1,2 losing id 1: exit 0\n%s", got.out)
	}
	if n := count(t, schema, "outbox"); n != 0 {
		t.Errorf("replay --ids 1,2 losing id 1 failed (%v) but moved %d event(s) into the outbox; want none moved, as its help says", got.err, n)
	}
}

// A schema name with surrounding blanks (a templated ONCEFLOW_SCHEMA="onceflow ")
// is taken as written: migrate up creates a second schema "onceflow " beside
// the producers' "onceflow", and a relay pointed at it runs healthy while
// the events written to onceflow.outbox are never published. --brokers
// trims blanks; --schema should refuse them.
func TestSchemaWithBlanksIsRefused(t *testing.T) {
	name := pgtest.NewSchemaName() + " "
	t.Cleanup(func() { pgtest.DropSchema(t, name) })
	out, err := runCLI(t, "migrate", "up", "--database-url", pgtest.URL(t), "--schema", name)
	if !errors.Is(err, errUsage) {
		t.Errorf("migrate up --schema %q: err %v, want a usage error (leading/trailing blanks)\n%s", name, err, firstLine(out))
	}
}
