package migrations_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// commitWhileItWaits runs run on a connection whose transactions default to
// REPEATABLE READ (set on a role, a database or in PGOPTIONS), commits a
// producer's event into schema's outbox while run waits for the outbox's
// lock, and returns run's error.
func commitWhileItWaits(t *testing.T, schema string, run func(*pgx.Conn) error) error {
	t.Helper()
	ctx := context.Background()
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	producer, err := pgtest.Conn(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = producer.Rollback(ctx) }()
	if _, err := producer.Exec(ctx, `INSERT INTO `+outbox+` (topic, value) VALUES ('t', 'pending')`); err != nil {
		t.Fatal(err)
	}
	conn := pgtest.Conn(t)
	if _, err := conn.Exec(ctx, `SET default_transaction_isolation = 'repeatable read'`); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- run(conn) }()
	waitFor(t, func() bool {
		var waiting bool
		_ = pgtest.Pool(t).QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE NOT granted AND relation = to_regclass($1))`, outbox).Scan(&waiting)
		return waiting
	})
	if err := producer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return <-done
}

// The recount after the lock sees what committed during the wait only under
// READ COMMITTED: under a session default of REPEATABLE READ its snapshot
// predated the wait, and a producer's event committed meanwhile was dropped
// with the outbox (G2; a cold review's case). Down and the printed revert
// run READ COMMITTED whatever the session's default.
func TestDownUnderARepeatableReadDefaultCountsAnEventCommittedWhileItWaits(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	var reverted []int
	err := commitWhileItWaits(t, schema, func(c *pgx.Conn) (err error) {
		reverted, err = migrations.Down(context.Background(), c, schema, migrations.Latest())
		return err
	})
	var loss *migrations.DataLossError
	if !errors.As(err, &loss) || len(reverted) != 0 || !tableExists(t, schema, "outbox") {
		t.Fatalf("Down: reverted %v, err %v, outbox there %v; want a DataLossError, nothing reverted", reverted, err, tableExists(t, schema, "outbox"))
	}
}

// The printed revert cannot choose its isolation (a tool may have begun
// the transaction): it refuses to run under another than READ COMMITTED,
// saying so, and drops nothing.
func TestPrintedRevertRefusesToRunUnderRepeatableRead(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	revertTo(t, schema, 1)
	err := runPrintedRevertOfStep1(t, schema, `SET default_transaction_isolation = 'repeatable read'`)
	if err == nil || !strings.Contains(err.Error(), "READ COMMITTED") || !tableExists(t, schema, "outbox") {
		t.Fatalf("the printed revert under repeatable read: err %v, outbox there %v; want a refusal naming READ COMMITTED", err, tableExists(t, schema, "outbox"))
	}
}

// A lock timeout past PostgreSQL's limit (about 24.8 days) is refused as
// such, not passed on to fail the revert with a raw 22023.
func TestDownWithALockTimeoutPastPostgreSQLsLimitSaysSo(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	_, err := migrations.DownWith(context.Background(), pgtest.Pool(t), schema, 1, &migrations.DownConfig{LockTimeout: 25 * 24 * time.Hour})
	if err == nil || !strings.Contains(err.Error(), "LockTimeout") {
		t.Fatalf("DownWith(LockTimeout 25 days): %v; want a refusal naming LockTimeout", err)
	}
}

// A role's statement_timeout shorter than the lock timeout cancels the
// wait first (57014): the failure still names who holds the table.
func TestDownCutShortByAStatementTimeoutNamesTheSessionsHoldingTheTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := pgtest.Schema(t)
	openReader(t, schema)
	conn := pgtest.Conn(t)
	if _, err := conn.Exec(ctx, `SET statement_timeout = '1s'`); err != nil {
		t.Fatal(err)
	}
	_, err := migrations.DownWith(ctx, conn, schema, migrations.Latest(), &migrations.DownConfig{LockTimeout: 5 * time.Second})
	if err == nil || !strings.Contains(err.Error(), openReaderApp) {
		t.Fatalf("Down behind an open reader, statement_timeout 1s: %v; want a failure naming the reader", err)
	}
}

// The printed revert's refusal names the schema in the command it suggests:
// run as suggested without it, the forced script is the default schema's.
func TestPrintedRevertsRefusalNamesItsSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := pgtest.Schema(t)
	revertTo(t, schema, 1)
	if _, err := pgtest.Pool(t).Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "outbox"}.Sanitize()+` (topic) VALUES ('t')`); err != nil {
		t.Fatal(err)
	}
	if err := runPrintedRevertOfStep1(t, schema); err == nil || !strings.Contains(err.Error(), "--schema "+schema+" ") {
		t.Fatalf("the printed revert's refusal: %v; want it to name --schema %s", err, schema)
	}
}

// openReaderApp is the application_name of the session openReader opens,
// which a lock wait's failure must name.
const openReaderApp = "oftest-open-reader"

// openReader opens a transaction that has read schema's outbox and stays
// open until the test ends (a psql session left open, say): it holds the
// outbox's ACCESS SHARE lock.
func openReader(t *testing.T, schema string) {
	t.Helper()
	ctx := context.Background()
	conn := pgtest.Conn(t)
	if _, err := conn.Exec(ctx, `SET application_name = '`+openReaderApp+`'`); err != nil {
		t.Fatal(err)
	}
	reader, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = reader.Rollback(context.Background()) })
	if _, err := reader.Exec(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "outbox"}.Sanitize()); err != nil {
		t.Fatal(err)
	}
}

// runPrintedRevertOfStep1 runs the printed revert of migration 1 on a
// connection of its own, as psql would, after the given settings.
func runPrintedRevertOfStep1(t *testing.T, schema string, settings ...string) error {
	t.Helper()
	ctx := context.Background()
	down, err := migrations.Script(schema, 1, true)
	if err != nil {
		t.Fatal(err)
	}
	conn := pgtest.Conn(t)
	for _, set := range settings {
		if _, err := conn.Exec(ctx, set); err != nil {
			t.Fatal(err)
		}
	}
	_, err = conn.PgConn().Exec(ctx, down).ReadAll()
	return err
}
