package main

import (
	"context"
	"errors"
	"io"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/internal/proctest"
	"github.com/onceflow/onceflow/migrations"
)

// migrate down refuses to drop an outbox holding pending events unless
// --force.
func TestMigrateDownRefusesPendingEventsWithoutForce(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	flags := []string{"--database-url", pgtest.URL(t), "--schema", schema}
	if _, err := pgtest.Pool(t).Exec(context.Background(), `INSERT INTO `+pgx.Identifier{schema, "outbox"}.Sanitize()+` (topic, value) VALUES ('t', 'pending')`); err != nil {
		t.Fatal(err)
	}
	all := strconv.Itoa(migrations.Latest()) // down to 0001, which drops the outbox
	out, err := runCLI(t, append([]string{"migrate", "down", "--steps", all}, flags...)...)
	if err == nil || !strings.Contains(err.Error(), "outbox") || !strings.Contains(err.Error(), "--force") {
		t.Fatalf("down --steps %s: %v\n%s", all, err, out)
	}
	if count(t, schema, "outbox") != 1 {
		t.Fatal("the pending event is gone")
	}
	if out, err = runCLI(t, append([]string{"migrate", "down", "--steps", all, "--force"}, flags...)...); err != nil || !strings.Contains(out, "reverted 0001") {
		t.Fatalf("down --force: %v\n%s", err, out)
	}
}

// migrate down on a schema that was never migrated creates nothing.
func TestMigrateDownOnANeverMigratedSchemaCreatesNothing(t *testing.T) {
	t.Parallel()
	schema := pgtest.EmptySchema(t)
	out, err := runCLI(t, "migrate", "down", "--database-url", pgtest.URL(t), "--schema", schema)
	if err != nil || !strings.Contains(out, "nothing to revert") {
		t.Fatalf("down: %v\n%s", err, out)
	}
	var exists bool
	if err := pgtest.Pool(t).QueryRow(context.Background(), `SELECT to_regnamespace($1) IS NOT NULL`, pgx.Identifier{schema}.Sanitize()).Scan(&exists); err != nil || exists {
		t.Fatalf("schema %s exists after down (err %v)", schema, err)
	}
}

// migrate print needs no database; its output, applied by another tool,
// leaves `migrate up` nothing to do and a relay that starts.
func TestMigratePrintAppliedByAnotherTool(t *testing.T) {
	t.Parallel()
	schema := pgtest.EmptySchema(t)
	script, err := runCLI(t, "migrate", "print", "--schema", schema)
	if err != nil {
		t.Fatalf("print: %v\n%s", err, script)
	}
	conn := pgtest.Conn(t)
	if _, err := conn.PgConn().Exec(context.Background(), script).ReadAll(); err != nil {
		t.Fatalf("apply the printed script: %v", err)
	}
	flags := []string{"--database-url", pgtest.URL(t), "--schema", schema}
	if out, err := runCLI(t, append([]string{"migrate", "up"}, flags...)...); err != nil || !strings.Contains(out, "up to date") {
		t.Fatalf("up after the printed script: %v\n%s", err, out)
	}
	if err := migrations.Check(context.Background(), pgtest.Pool(t), schema); err != nil {
		t.Fatalf("the relay's schema check: %v", err)
	}
	// The relay starts on it.
	k := kafkatest.New(t)
	ctx, cancel := context.WithCancel(context.Background())
	logs := &proctest.Buffer{}
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, append([]string{"relay", "--brokers", strings.Join(k.Brokers, ","), "--lease-duration", "2s"}, flags...), io.Discard, logs)
	}()
	waitUntil(t, "the relay to start", time.Minute, func() bool { return strings.Contains(logs.String(), "relay started") })
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("relay: %v\n%s", err, logs)
	}
	one, err := runCLI(t, "migrate", "print", "--schema", schema, "--version", "1")
	if err != nil || !strings.Contains(one, "INSERT INTO schema_migrations") || strings.Contains(one, "idempotency_keys") {
		t.Fatalf("print --version 1: %v\n%s", err, one)
	}
	down, err := runCLI(t, "migrate", "print", "--schema", schema, "--version", "2", "--down")
	if err != nil || !strings.Contains(down, "DROP TABLE IF EXISTS idempotency_keys") || !strings.Contains(down, "DELETE FROM schema_migrations") {
		t.Fatalf("print --version 2 --down: %v\n%s", err, down)
	}
	if _, err := runCLI(t, "migrate", "print", "--version", "99"); !errors.Is(err, errUsage) {
		t.Fatalf("print --version 99: err %v, want a usage error", err)
	}
}
