package main

import (
	"context"
	"net/url"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgbouncertest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// withSetting returns the test database's URL with a setting every session
// starts with (libpq's options), as a database or role may carry it.
func withSetting(t *testing.T, setting string) string {
	t.Helper()
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("options", "-c "+setting)
	u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20") // pgx reads no + as a space
	return u.String()
}

// The reading commands pick exec mode, whose results come as text; under
// a bytea_output or DateStyle pgx cannot read as text they failed with a
// scan error ("invalid hex format", "invalid PostgreSQL date/time value").
// They must read as under the defaults; replay and discard too.
func TestReadingCommandsUnderTextResultSettings(t *testing.T) {
	t.Parallel()
	for _, setting := range []string{"bytea_output=escape", "DateStyle=German", "DateStyle=SQL,DMY", "DateStyle=Postgres,MDY"} {
		t.Run(setting, func(t *testing.T) {
			t.Parallel()
			schema, _ := deadSetup(t, 2)
			ctx := context.Background()
			// A relay row, so that status reads its timestamps.
			if _, err := pgtest.Pool(t).Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "outbox"}.Sanitize()+
				` (event_id, topic, key, value) VALUES (gen_random_uuid(), 't', '\x00ff', 'v')`); err != nil {
				t.Fatal(err)
			}
			flags := []string{"--database-url", withSetting(t, setting), "--schema", schema}
			if out, err := runCLI(t, append([]string{"dead", "list"}, flags...)...); err != nil || !strings.Contains(out, "unknown topic") {
				t.Errorf("dead list: %v\n%s", err, out)
			}
			if out, err := runCLI(t, append([]string{"dead", "list", "--json"}, flags...)...); err != nil || !strings.Contains(out, "unknown topic") {
				t.Errorf("dead list --json: %v\n%s", err, out)
			}
			if out, err := runCLI(t, append([]string{"status"}, flags...)...); err != nil || !strings.Contains(out, "backlog:         1 events") {
				t.Errorf("status: %v\n%s", err, out)
			}
			if out, err := runCLI(t, append([]string{"migrate", "status"}, flags...)...); err != nil || !strings.Contains(out, "applied") {
				t.Errorf("migrate status: %v\n%s", err, out)
			}
			if out, err := runCLI(t, append([]string{"dead", "replay", "--ids", "1"}, flags...)...); err != nil || !strings.Contains(out, "replayed 1") {
				t.Errorf("dead replay: %v\n%s", err, out)
			}
			if out, err := runCLI(t, append([]string{"dead", "discard", "--ids", "2"}, flags...)...); err != nil || !strings.Contains(out, "unknown topic") || !strings.Contains(out, "discarded 1") {
				t.Errorf("dead discard: %v\n%s", err, out)
			}
			// migrate down and up read the server's clock (helper 113).
			if out, err := runCLI(t, append([]string{"migrate", "down", "--steps", "1"}, flags...)...); err != nil || !strings.Contains(out, "reverted") {
				t.Errorf("migrate down: %v\n%s", err, out)
			}
			if out, err := runCLI(t, append([]string{"migrate", "up"}, flags...)...); err != nil || !strings.Contains(out, "applied") {
				t.Errorf("migrate up: %v\n%s", err, out)
			}
		})
	}
}

// Behind PgBouncer in transaction mode, where a session SET would not
// follow the command from one transaction to the next, the reading
// commands read under a DateStyle pgx cannot read as text (PgBouncer
// passes a client's DateStyle to every server connection it lends it).
func TestReadingCommandsUnderTextResultSettingsBehindPgBouncer(t *testing.T) {
	pgb := pgbouncertest.Start(t)
	schema, _ := deadSetup(t, 1)
	flags := []string{"--database-url", pgb.TransactionURL + "&DateStyle=German", "--schema", schema}
	for _, args := range [][]string{{"dead", "list"}, {"status"}, {"migrate", "status"}, {"dead", "discard", "--ids", "1"}} {
		if out, err := runCLI(t, append(args, flags...)...); err != nil {
			t.Errorf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}
