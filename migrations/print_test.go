package migrations_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// execScript runs SQL text as another migration tool (or psql) would: the
// simple protocol, many statements in one string.
func execScript(t *testing.T, sql string) {
	t.Helper()
	conn := pgtest.Conn(t)
	if _, err := conn.PgConn().Exec(context.Background(), sql).ReadAll(); err != nil {
		t.Fatalf("apply script: %v\n%s", err, sql)
	}
}

// The printed script, applied by another tool, records its versions: Up
// finds nothing to do and Check passes.
func TestScriptAppliedByAnotherToolIsRecorded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.EmptySchema(t)
	script, err := migrations.Script(schema, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	execScript(t, script)
	if err := migrations.Check(ctx, pool, schema); err != nil {
		t.Fatalf("Check after the script: %v", err)
	}
	if applied, err := migrations.Up(ctx, pool, schema); err != nil || len(applied) != 0 {
		t.Fatalf("Up after the script: applied %v, err %v; want nothing to do", applied, err)
	}
	var searchPath string
	if err := pool.QueryRow(ctx, `SHOW search_path`).Scan(&searchPath); err != nil || strings.Contains(searchPath, schema) {
		t.Fatalf("search_path %q, err %v", searchPath, err)
	}
}

// One step at a time, as tools that keep one file per version apply them;
// down steps unrecord themselves.
func TestScriptOneVersionAtATime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.EmptySchema(t)
	all, _ := migrations.All()
	for _, m := range all[:len(all)-1] {
		s, err := migrations.Script(schema, m.Version, false)
		if err != nil {
			t.Fatal(err)
		}
		execScript(t, s)
	}
	var missing *migrations.MissingError
	err := migrations.Check(ctx, pool, schema)
	if !errors.As(err, &missing) || len(missing.Missing) != 1 || missing.Missing[0].Version != migrations.Latest() {
		t.Fatalf("Check with the last step missing: %v", err)
	}
	if !strings.Contains(err.Error(), all[len(all)-1].Name) {
		t.Errorf("Check's error %q does not name the missing migration", err)
	}
	last, _ := migrations.Script(schema, migrations.Latest(), false)
	execScript(t, last)
	if err := migrations.Check(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	down, err := migrations.Script(schema, migrations.Latest(), true)
	if err != nil {
		t.Fatal(err)
	}
	execScript(t, down)
	if err := migrations.Check(ctx, pool, schema); !errors.As(err, &missing) {
		t.Fatalf("Check after the down script: %v", err)
	}
	if _, err := migrations.Script(schema, 99, false); err == nil {
		t.Error("Script accepted an unknown version")
	}
}

// Check on a schema without a version table says so, whether or not the
// tables are there (applied by hand from the files).
func TestCheckWithoutVersionTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.EmptySchema(t)
	var missing *migrations.MissingError
	if err := migrations.Check(ctx, pool, schema); !errors.As(err, &missing) || len(missing.Missing) != migrations.Latest() {
		t.Fatalf("Check on a missing schema: %v", err)
	}
	all, _ := migrations.All()
	execScript(t, `CREATE SCHEMA `+pgx.Identifier{schema}.Sanitize()+`; SET search_path TO `+pgx.Identifier{schema}.Sanitize()+`, public; `+all[0].Up+`; RESET search_path`)
	err := migrations.Check(ctx, pool, schema)
	// Not `onceflow migrate print` output nor `migrate up`, which fail on
	// the tables there: the SQL that records them.
	if !errors.As(err, &missing) || strings.Contains(err.Error(), "migrate print") || !strings.Contains(err.Error(), "INSERT INTO") {
		t.Fatalf("Check on hand-applied tables: %v", err)
	}
}

// A printed revert of a step beneath a newer one fails whole: it reverted
// the step under the newer one, leaving a schema no version of onceflow
// matched (at version 7, reverting 6 dropped the domains 7 had changed).
func TestScriptRevertsOnlyTheNewestStep(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.Schema(t)
	down, err := migrations.Script(schema, migrations.Latest()-1, true)
	if err != nil {
		t.Fatal(err)
	}
	_, err = pgtest.Conn(t).PgConn().Exec(ctx, down).ReadAll()
	if err == nil || !strings.Contains(err.Error(), "newer") {
		t.Fatalf("the revert of step %d beneath %d: err %v, want a refusal", migrations.Latest()-1, migrations.Latest(), err)
	}
	if err := migrations.Check(ctx, pool, schema); err != nil {
		t.Fatalf("the refused revert changed the schema: %v", err)
	}
}

// revertTo applies the printed down scripts of the newest steps down to
// (not including) version to, as a tool keeping one file per version does.
func revertTo(t *testing.T, schema string, to int) {
	t.Helper()
	for v := migrations.Latest(); v > to; v-- {
		s, err := migrations.Script(schema, v, true)
		if err != nil {
			t.Fatal(err)
		}
		execScript(t, s)
	}
}

// A printed revert refuses, dropping nothing, when a table it drops holds
// rows, as Down does: it dropped the outbox with its pending events, so a
// team applying it with its own tool lost them silently where `onceflow
// migrate down` refused. The forced script (ScriptForce, `migrate print
// --down --force`) drops them, as DownForce does.
func TestPrintedRevertRefusesToDropTablesHoldingRows(t *testing.T) {
	t.Parallel()
	cases := []struct {
		table, insert string
		version       int
	}{
		{"outbox", `INSERT INTO outbox (topic, value) VALUES ('t', 'pending')`, 1},
		{"outbox_dead", `INSERT INTO outbox_dead (outbox_id, event_id, topic, created_at, error, attempts) VALUES (1, gen_random_uuid(), 't', now(), 'refused', 1)`, 1},
		{"processed_messages", `INSERT INTO processed_messages (consumer, message_id) VALUES ('c', 'm')`, 1},
		{"idempotency_keys", `INSERT INTO idempotency_keys (scope, key, fingerprint, token, expires_at) VALUES ('do:x', 'k', '\x00', gen_random_uuid(), now() + interval '1 day')`, 2},
	}
	for _, c := range cases {
		t.Run(c.table, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := pgtest.Pool(t)
			schema := pgtest.Schema(t)
			if _, err := pool.Exec(ctx, `SET search_path TO `+pgx.Identifier{schema}.Sanitize()+`; `+c.insert+`; RESET search_path`); err != nil {
				t.Fatal(err)
			}
			revertTo(t, schema, c.version)
			down, err := migrations.Script(schema, c.version, true)
			if err != nil {
				t.Fatal(err)
			}
			_, err = pgtest.Conn(t).PgConn().Exec(ctx, down).ReadAll()
			if err == nil || !strings.Contains(err.Error(), c.table) || !strings.Contains(err.Error(), "--force") {
				t.Fatalf("the revert of step %d with rows in %s: err %v, want a refusal naming it and --force", c.version, c.table, err)
			}
			if out, err := psqlApply(t, down); err == nil || !strings.Contains(out, c.table) {
				t.Fatalf("psql applied the revert of step %d with rows in %s:\n%s", c.version, c.table, out)
			}
			if !tableExists(t, schema, c.table) {
				t.Fatalf("a refused revert dropped %s", c.table)
			}
			var recorded bool
			if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM `+pgx.Identifier{schema, "schema_migrations"}.Sanitize()+` WHERE version = $1)`, c.version).Scan(&recorded); err != nil || !recorded {
				t.Fatalf("a refused revert unrecorded step %d (err %v)", c.version, err)
			}
			forced, err := migrations.ScriptForce(schema, c.version)
			if err != nil {
				t.Fatal(err)
			}
			execScript(t, forced)
			if tableExists(t, schema, c.table) {
				t.Fatalf("%s still exists after the forced revert", c.table)
			}
		})
	}
}

// An event whose transaction commits while a printed revert runs is
// counted before anything is dropped: the revert locks the tables it
// drops before it counts again, as Down does.
func TestPrintedRevertCountsAnEventThatCommitsWhileItWaits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.Schema(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	revertTo(t, schema, 1)
	producer, err := pgtest.Conn(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = producer.Rollback(ctx) }()
	if _, err := producer.Exec(ctx, `INSERT INTO `+outbox+` (topic, value) VALUES ('t', 'pending')`); err != nil {
		t.Fatal(err)
	}
	down, err := migrations.Script(schema, 1, true)
	if err != nil {
		t.Fatal(err)
	}
	conn := pgtest.Conn(t)
	done := make(chan error, 1)
	go func() {
		_, err := conn.PgConn().Exec(ctx, down).ReadAll()
		done <- err
	}()
	waitFor(t, func() bool {
		var waiting bool
		_ = pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE NOT granted AND relation = to_regclass($1))`, outbox).Scan(&waiting)
		return waiting
	})
	if err := producer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err == nil || !strings.Contains(err.Error(), "outbox") {
		t.Fatalf("the revert of step 1 while an event committed: err %v, want a refusal naming outbox", err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+outbox).Scan(&n); err != nil || n != 1 {
		t.Fatalf("the outbox holds %d rows (err %v), want the committed event", n, err)
	}
}

// A printed revert waits a bounded time for a table's lock: behind an open
// transaction that read the outbox it gives up (after the session's
// lock_timeout, else 5 s), naming the session that holds it.
func TestPrintedRevertGivesUpOnALockItCannotGet(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	revertTo(t, schema, 1)
	openReader(t, schema)
	err := runPrintedRevertOfStep1(t, schema, `SET lock_timeout = '300ms'`)
	if err == nil || !strings.Contains(err.Error(), openReaderApp) || !strings.Contains(err.Error(), "300ms") {
		t.Fatalf("the revert of step 1 behind an open reader: err %v, want a failure naming the reader", err)
	}
	if !tableExists(t, schema, "outbox") {
		t.Fatal("the failed revert dropped the outbox")
	}
}
