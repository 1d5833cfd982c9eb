package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

func runCLI(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := run(context.Background(), args, &out, &errOut)
	return out.String() + errOut.String(), err
}

func TestBadInputIsAUsageError(t *testing.T) {
	t.Setenv("ONCEFLOW_DATABASE_URL", "")
	t.Setenv("ONCEFLOW_BROKERS", "")
	url := pgtest.URL(t)
	cases := map[string][]string{
		"no command":       {},
		"unknown command":  {"frobnicate"},
		"no database url":  {"status"},
		"bad database url": {"status", "--database-url", "::nope"},
		"relay no brokers": {"relay", "--database-url", url},
		"broker not h:p":   {"relay", "--database-url", url, "--brokers", "localhost"},
		"bad publisher":    {"relay", "--database-url", url, "--brokers", "a:1", "--publisher", "sarama"},
		"bad log level":    {"status", "--database-url", url, "--log-level", "loud"},
		"stray argument":   {"status", "--database-url", url, "extra"},
		"migrate sideways": {"migrate", "sideways"},
		"replay nothing":   {"dead", "replay", "--database-url", url},
		"replay bad id":    {"dead", "replay", "--database-url", url, "--ids", "x"},
		"schema too long":  {"status", "--database-url", url, "--schema", strings.Repeat("s", 64)},
	}
	// An explicit zero is not taken for "the default": each would mean
	// something else (dead-letter at once, never wait) or nothing.
	for _, flag := range []string{"--batch-size", "--batch-bytes", "--probe-interval", "--poll-interval", "--lease-duration",
		"--unknown-topic-grace", "--topic-forbidden-grace", "--publish-timeout", "--kafka-handoff"} {
		cases["relay "+flag+" 0"] = []string{"relay", "--database-url", url, "--brokers", "127.0.0.1:1", flag, "0"}
	}
	for name, args := range cases {
		if _, err := runCLI(t, args...); !errors.Is(err, errUsage) {
			t.Errorf("%s: err = %v, want a usage error", name, err)
		}
	}
}

// TestRelayMaxHeldKeysFlag: the cap on held keys is the binary's to set
// too, and a negative one is refused naming the flag.
func TestRelayMaxHeldKeysFlag(t *testing.T) {
	_, err := runCLI(t, "relay", "--database-url", pgtest.URL(t), "--brokers", "127.0.0.1:1", "--max-held-keys", "-1")
	if !errors.Is(err, errUsage) || !strings.Contains(err.Error(), "--max-held-keys: -1") {
		t.Fatalf("err = %v, want a usage error naming --max-held-keys", err)
	}
	out, err := runCLI(t, "relay", "--help")
	if !strings.Contains(out, "max-held-keys") || !strings.Contains(out, "ONCEFLOW_MAX_HELD_KEYS") {
		t.Fatalf("relay --help (err %v) does not show --max-held-keys:\n%s", err, out)
	}
}

func TestUnreachableDatabaseFailsAtStart(t *testing.T) {
	_, err := runCLI(t, "relay", "--database-url", "postgres://postgres@127.0.0.1:1/x?connect_timeout=2", "--brokers", "127.0.0.1:9092", "--wait-for-database=false")
	if err == nil || errors.Is(err, errUsage) || !strings.Contains(err.Error(), "connect to database") {
		t.Fatalf("err = %v, want a connection error", err)
	}
}

func TestMigrateStatusDeadReplay(t *testing.T) {
	schema := pgtest.EmptySchema(t)
	url := pgtest.URL(t)
	common := []string{"--database-url", url, "--schema", schema}
	out, err := runCLI(t, append([]string{"migrate", "status"}, common...)...)
	if err != nil || !strings.Contains(out, "0001 init") || !strings.Contains(out, "pending") {
		t.Fatalf("status before up: %v\n%s", err, out)
	}
	if out, err = runCLI(t, append([]string{"migrate", "up"}, common...)...); err != nil || !strings.Contains(out, "applied 0001") {
		t.Fatalf("up: %v\n%s", err, out)
	}
	if out, err = runCLI(t, append([]string{"migrate", "up"}, common...)...); err != nil || !strings.Contains(out, "up to date") {
		t.Fatalf("second up: %v\n%s", err, out)
	}
	ctx := context.Background()
	pool := pgtest.Pool(t)
	_, err = pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "outbox_dead"}.Sanitize()+
		` (outbox_id, event_id, topic, key, value, created_at, error, attempts) VALUES (1, gen_random_uuid(), 'gone', 'k', 'v', now(), 'unknown topic', 3)`)
	if err != nil {
		t.Fatal(err)
	}
	if out, err = runCLI(t, append([]string{"dead", "list"}, common...)...); err != nil || !strings.Contains(out, "unknown topic") {
		t.Fatalf("dead list: %v\n%s", err, out)
	}
	if out, err = runCLI(t, append([]string{"dead", "replay", "--all"}, common...)...); err != nil || !strings.Contains(out, "replayed 1") {
		t.Fatalf("dead replay: %v\n%s", err, out)
	}
	if out, err = runCLI(t, append([]string{"status"}, common...)...); err != nil || !strings.Contains(out, "backlog:         1 events") || !strings.Contains(out, "dead letters:    0") {
		t.Fatalf("status: %v\n%s", err, out)
	}
	if out, err = runCLI(t, append([]string{"migrate", "down", "--steps", strconv.Itoa(migrations.Latest())}, common...)...); err == nil || !strings.Contains(err.Error(), "outbox (1 rows)") {
		t.Fatalf("down with a pending event: %v\n%s", err, out)
	}
	if out, err = runCLI(t, append([]string{"migrate", "down", "--steps", strconv.Itoa(migrations.Latest()), "--force"}, common...)...); err != nil || !strings.Contains(out, "reverted 0001") {
		t.Fatalf("down: %v\n%s", err, out)
	}
}

// Bad input is one line (main prints the returned error) and exit code 2:
// a flag error printed the whole flag list as well, twice the error with
// 80 lines between. --help still prints the flag list, and a pool size or
// HTTP address out of range is bad input too, found before anything
// connects.
func TestBadFlagsAreOneLine(t *testing.T) {
	url := pgtest.URL(t)
	cases := map[string][]string{
		"unknown flag":        {"relay", "--bogus-flag"},
		"flag without value":  {"status", "--database-url"},
		"bad boolean":         {"relay", "--wait-for-database=maybe"},
		"dead discard --all":  {"dead", "discard", "--all"},
		"pool size negative":  {"status", "--database-url", url, "--database-pool-size", "-1"},
		"relay pool negative": {"relay", "--database-url", url, "--brokers", "127.0.0.1:1", "--database-pool-size", "-1"},
		"http addr no port":   {"relay", "--database-url", url, "--brokers", "127.0.0.1:1", "--http-addr", "bogus"},
		"http port too high":  {"relay", "--database-url", url, "--brokers", "127.0.0.1:1", "--http-addr", ":99999"},
		"migrate bad flag":    {"migrate", "up", "--nope"},
		"print bad flag":      {"migrate", "print", "--nope"},
	}
	for name, args := range cases {
		var out, errOut bytes.Buffer
		err := run(context.Background(), args, &out, &errOut)
		if !errors.Is(err, errUsage) {
			t.Errorf("%s: err = %v, want a usage error", name, err)
		}
		if errOut.Len() > 0 || out.Len() > 0 {
			t.Errorf("%s: printed more than the error's line:\n%s%s", name, out.String(), errOut.String())
		}
	}
	if out, err := runCLI(t, "status", "--help"); !errors.Is(err, flag.ErrHelp) || !strings.Contains(out, "-database-url") {
		t.Errorf("status --help: err %v, output:\n%s", err, out)
	}
}

// status and dead on a schema that was never migrated (a typo in
// ONCEFLOW_SCHEMA) say so and what to run, as the relay does, instead of
// PostgreSQL's "relation … does not exist (SQLSTATE 42P01)".
func TestAdminCommandsOnAnUnmigratedSchemaSaySo(t *testing.T) {
	url := pgtest.URL(t)
	for _, args := range [][]string{
		{"status"}, {"status", "--json"}, {"dead", "list"}, {"dead", "replay", "--ids", "1"}, {"dead", "discard", "--ids", "1"},
	} {
		_, err := runCLI(t, append(args, "--database-url", url, "--schema", "oftest_never_migrated")...)
		if err == nil || errors.Is(err, errUsage) || !strings.Contains(err.Error(), "migrate up") || strings.Contains(err.Error(), "SQLSTATE") {
			t.Errorf("%v: err = %v, want a runtime error saying to run migrate up", args, err)
		}
	}
}

// A linger the publish timeout cannot cover is bad input: each value was
// accepted on its own, and then a round's records waited out the linger
// before they were sent, so every round timed out and nothing was
// published (6 of 10 events pending after 25 s with --linger 3s
// --publish-timeout 2s, on both publishers; helper 71). franz-go's own
// limit on the linger (1 min) was a runtime error after connecting,
// naming no flag.
func TestALingerThePublishTimeoutCannotCoverIsRefused(t *testing.T) {
	url := pgtest.URL(t)
	base := []string{"relay", "--database-url", url, "--brokers", "127.0.0.1:1"}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--linger", "3s", "--publish-timeout", "2s"}, "--linger: 3s is not shorter than --publish-timeout (2s)"},
		{[]string{"--publisher", "kafka-go", "--linger", "2s", "--publish-timeout", "2s"}, "--linger: 2s is not shorter than --publish-timeout (2s)"},
		{[]string{"--linger", "45s"}, "--linger: 45s is not shorter than --publish-timeout (30s)"},
		{[]string{"--linger", "61s", "--publish-timeout", "5m"}, "--linger: 1m1s is longer than franz-go allows (1m0s)"},
	} {
		var out, errOut bytes.Buffer
		err := run(context.Background(), append(base, c.args...), &out, &errOut)
		if !errors.Is(err, errUsage) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: err = %v, want a usage error saying %q", c.args, err, c.want)
		}
	}
}
