package migrations

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Latest returns the newest migration's version: what this build of onceflow
// needs applied.
func Latest() int {
	all, err := All()
	if err != nil || len(all) == 0 {
		return 0 // malformed embedded files: All fails in every test
	}
	return all[len(all)-1].Version
}

// Script returns SQL text that applies the migrations to schema the way Up
// does, for teams that run their own migration tool: it creates the schema
// and the version table if missing, sets search_path, runs each migration
// and records it in schema_migrations, so `onceflow migrate up` and the
// relay's schema check see it. Apply it in one transaction, as Up runs
// (psql -1, or a tool that wraps each file in a transaction): a step may
// lock a table, which PostgreSQL allows only in a transaction block. It
// takes no advisory lock: apply it from one place.
//
// version 0 means every migration, in order, as one script; otherwise only
// that version's step. With down, the step's revert (which unrecords it);
// down needs a version, and its script is one transaction that first
// checks the schema holds that step as its newest, with the schema alone on
// its search_path: applied to the wrong schema, twice, or beneath a newer
// step, it fails whole and drops nothing. Like Down, it also refuses,
// dropping nothing, when a table it drops holds rows that count (pending
// events, dead letters, dedup records, idempotency keys, dead events'
// write order, live janitor windows: heldRows): it counts them, then locks
// the tables (waiting at most 5 s unless the session sets lock_timeout)
// and counts again. ScriptForce drops them.
func Script(schema string, version int, down bool) (string, error) {
	return script(schema, version, down, false)
}

// ScriptForce is the down script of version (Script(schema, version, true))
// without the guard that refuses to drop a table holding rows: it drops
// them, as DownForce does.
func ScriptForce(schema string, version int) (string, error) {
	return script(schema, version, true, true)
}

func script(schema string, version int, down, force bool) (string, error) {
	if err := ValidateSchema(schema); err != nil {
		return "", fmt.Errorf("migrations: %w", err)
	}
	all, err := All()
	if err != nil {
		return "", err
	}
	var steps []Migration
	for _, m := range all {
		if version == 0 || m.Version == version {
			steps = append(steps, m)
		}
	}
	switch {
	case version != 0 && len(steps) == 0:
		return "", fmt.Errorf("migrations: no migration %d (the latest is %d)", version, Latest())
	case down && version == 0:
		return "", fmt.Errorf("migrations: a down script needs a version")
	}
	ident := pgx.Identifier{schema}.Sanitize()
	var b strings.Builder
	direction := "up"
	if down {
		direction = "down"
	}
	fmt.Fprintf(&b, "-- onceflow schema migrations (%s) for schema %s, printed by `onceflow migrate print`.\n", direction, ident)
	if force {
		b.WriteString("-- Forced (--force): drops its tables whatever rows they hold.\n")
	}
	b.WriteString("-- Each step records itself in schema_migrations, which `onceflow migrate up` and the relay read.\n")
	if down {
		// One transaction, and the schema alone on the path: a revert must
		// never reach public's tables of the same names (a mistyped
		// schema, a step reverted twice), and psql, which goes on after an
		// error, must not run the steps after a failed one. The guard
		// fails unless the schema exists and holds this step as its newest.
		b.WriteString("BEGIN;\n")
		fmt.Fprintf(&b, "SET LOCAL search_path TO %s;\n", ident)
		// The body names no schema (search_path does), so no name can
		// end its quoting.
		fmt.Fprintf(&b, `DO $onceflow$ BEGIN
    IF current_schema() IS NULL OR to_regclass('schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'onceflow: schema %% does not exist or was never migrated', current_setting('search_path');
    END IF;
    IF NOT EXISTS (SELECT FROM schema_migrations WHERE version = %d) THEN
        RAISE EXCEPTION 'onceflow: migration %d is not applied in schema %%', current_schema();
    END IF;
    IF EXISTS (SELECT FROM schema_migrations WHERE version > %d) THEN
        RAISE EXCEPTION 'onceflow: schema %% holds migrations newer than %d: revert those first, newest first', current_schema();
    END IF;
END $onceflow$;
`, version, version, version, version)
		if tables := dataTablesDropped(steps); len(tables) > 0 && !force {
			b.WriteString(dataGuard(version, tables))
		}
	} else {
		// No BEGIN/COMMIT: migration tools run each file in a transaction
		// of their own (an inner COMMIT would end theirs early), and psql
		// is told to (-1). The steps need one: migration 7 locks a table.
		b.WriteString("-- Apply it in one transaction, as `onceflow migrate up` does: psql -1 -v ON_ERROR_STOP=1 -f FILE,\n")
		b.WriteString("-- or a tool that runs each file in a transaction (goose, Flyway and Atlas do by default).\n")
		// goose reads a file only through its annotations, and splits the
		// rest at every line ending in a semicolon, dollar-quoted bodies
		// included: the whole file is one statement for it, run in its
		// transaction. For psql and Flyway these lines are comments. The
		// file has no Down part, which psql would run too.
		b.WriteString("-- The goose annotations below make it a goose migration (one statement, no Down part); psql and Flyway ignore them.\n")
		b.WriteString("-- +goose Up\n-- +goose StatementBegin\n")
		// The caller's search_path (a tool's own, say) is kept and put
		// back at the end; public stays on the path for gen_random_uuid
		// and extensions.
		b.WriteString("SELECT set_config('onceflow.caller_search_path', current_setting('search_path'), false);\n")
		fmt.Fprintf(&b, "SET search_path TO %s, public;\n", ident)
		b.WriteString(createMissing(schema))
	}
	for _, m := range steps {
		fmt.Fprintf(&b, "\n-- %04d_%s.%s.sql\n", m.Version, m.Name, direction)
		if down {
			b.WriteString(strings.TrimRight(m.Down, "\n") + "\n")
			fmt.Fprintf(&b, "DELETE FROM schema_migrations WHERE version = %d;\n", m.Version)
		} else {
			b.WriteString(strings.TrimRight(m.Up, "\n") + "\n")
			fmt.Fprintf(&b, "INSERT INTO schema_migrations (version, name) VALUES (%d, '%s');\n", m.Version, strings.ReplaceAll(m.Name, "'", "''"))
		}
	}
	if down {
		b.WriteString("\nCOMMIT;\n")
	} else {
		b.WriteString("\nSELECT set_config('search_path', current_setting('onceflow.caller_search_path'), false);\n")
		b.WriteString("-- +goose StatementEnd\n")
	}
	return b.String(), nil
}

// createMissing is the up script's creation of schema and its version
// table, each only when missing, as Up does: PostgreSQL checks the
// privilege to create a schema (CREATE on the database) or a table before
// IF NOT EXISTS looks, and the owner of a schema an administrator created
// often lacks the first. search_path names the schema already.
func createMissing(schema string) string {
	// The name is in the body twice, as a literal and as an identifier:
	// the body's quote is one the name does not hold, so the name cannot
	// end it. An E'' literal reads the same whatever
	// standard_conforming_strings says.
	tag := "$onceflow$"
	for strings.Contains(schema, tag) {
		tag = tag[:len(tag)-1] + "_$"
	}
	literal := "E'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(schema) + "'"
	table := strings.Replace(versionTableSQL, "CREATE TABLE IF NOT EXISTS", "CREATE TABLE", 1)
	return fmt.Sprintf(`DO %[1]s BEGIN
    IF NOT EXISTS (SELECT FROM pg_namespace WHERE nspname = %[2]s) THEN
        CREATE SCHEMA %[3]s;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_tables WHERE schemaname = %[2]s AND tablename = 'schema_migrations') THEN
        %[4]s;
    END IF;
END %[1]s;
`, tag, literal, pgx.Identifier{schema}.Sanitize(), strings.ReplaceAll(table, "\n", "\n    "))
}

// Querier is satisfied by *pgxpool.Pool, *pgx.Conn and pgx.Tx.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// MissingError is Check's answer when a migration this build needs is not
// recorded as applied.
type MissingError struct {
	Schema string
	// Missing lists the migrations not recorded, in version order.
	Missing []Migration
	// NoVersionTable is set when schema_migrations does not exist; Tables
	// then says whether onceflow's outbox table does (files applied by
	// hand). With both, Error gives the SQL that creates the version table
	// and records the versions applied (1 to a placeholder <N> the
	// operator fills in), and Up refuses the schema with this error.
	NoVersionTable, Tables bool
}

func (e *MissingError) Error() string {
	names := make([]string, len(e.Missing))
	for i, m := range e.Missing {
		names[i] = fmt.Sprintf("%04d_%s", m.Version, m.Name)
	}
	ident := pgx.Identifier{e.Schema}.Sanitize()
	if e.NoVersionTable && e.Tables {
		return fmt.Sprintf("migrations: schema %s has onceflow's tables but no schema_migrations table (applied from the files by another tool?), "+
			"so no migration is recorded and `onceflow migrate up` would fail creating what is there. "+
			"Record the versions applied, 1 to <N>, <N> the highest NNNN of the up files your tool ran: `%s` "+
			"then run `onceflow migrate up` for the rest",
			ident, recordSQL(e.Schema, e.Missing))
	}
	return fmt.Sprintf("migrations: schema %s lacks %s: run `onceflow migrate up` (or apply `onceflow migrate print --version N` with your own tool)",
		ident, strings.Join(names, ", "))
}

// recordSQL is the SQL, on one line, that creates schema's version table
// and records the versions of steps up to <N>, a placeholder the operator
// replaces (left in place it is a syntax error, recording nothing).
func recordSQL(schema string, steps []Migration) string {
	values := make([]string, len(steps))
	for i, m := range steps {
		values[i] = fmt.Sprintf("(%d, '%s')", m.Version, strings.ReplaceAll(m.Name, "'", "''"))
	}
	table := pgx.Identifier{schema, "schema_migrations"}.Sanitize()
	create := strings.Replace(strings.Join(strings.Fields(versionTableSQL), " "), "schema_migrations (", table+" (", 1)
	create = strings.Replace(create, "( ", "(", 1)
	return fmt.Sprintf("BEGIN; %s; INSERT INTO %s (version, name) SELECT v, n FROM (VALUES %s) m (v, n) WHERE v <= <N>; COMMIT;",
		create, table, strings.Join(values, ", "))
}

// Check reports, as a *MissingError, every migration up to Latest that is
// not recorded in schema's version table. Versions newer than this build
// knows are fine (a newer onceflow migrated first). It only reads.
func Check(ctx context.Context, db Querier, schema string) error {
	if err := ValidateSchema(schema); err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	all, err := All()
	if err != nil {
		return err
	}
	// One round trip when the version table is there (the relay's start).
	hasOutbox := true
	applied := map[int]bool{}
	versions, hasVersions, err := appliedVersions(ctx, db, schema)
	if err != nil {
		return err
	}
	if !hasVersions {
		err = db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, pgx.Identifier{schema, "outbox"}.Sanitize()).Scan(&hasOutbox)
		if err != nil {
			return fmt.Errorf("migrations: check schema %s: %w", schema, err)
		}
	}
	for _, v := range versions {
		applied[int(v)] = true
	}
	missing := &MissingError{Schema: schema, NoVersionTable: !hasVersions, Tables: hasOutbox}
	for _, m := range all {
		if !applied[m.Version] {
			missing.Missing = append(missing.Missing, m)
		}
	}
	if len(missing.Missing) > 0 {
		return missing
	}
	return nil
}

// Newer returns the versions recorded in schema's version table that this
// build does not know, in order: a newer onceflow applied them (a rolling
// upgrade under way, or a release rolled back without its migrations). A
// schema without a version table has none. It only reads.
func Newer(ctx context.Context, db Querier, schema string) ([]int, error) {
	if err := ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	all, err := All()
	if err != nil {
		return nil, err
	}
	versions, _, err := appliedVersions(ctx, db, schema)
	if err != nil {
		return nil, err
	}
	done := make(map[int]time.Time, len(versions))
	for _, v := range versions {
		done[int(v)] = time.Time{}
	}
	return unknownVersions(all, done), nil
}

// appliedVersions reads the versions recorded in schema's version table;
// hasTable is false, with no error, when the table or the schema is not
// there.
func appliedVersions(ctx context.Context, db Querier, schema string) (versions []int32, hasTable bool, err error) {
	err = db.QueryRow(ctx, `SELECT coalesce(array_agg(version), '{}') FROM `+pgx.Identifier{schema, "schema_migrations"}.Sanitize()).Scan(&versions)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000"): // undefined table or schema
		return nil, false, nil
	case err != nil:
		return nil, false, fmt.Errorf("migrations: read versions of schema %s: %w", schema, err)
	}
	return versions, true, nil
}

// dataTablesDropped returns the data tables the reverts of steps drop, in
// dataTables' order.
func dataTablesDropped(steps []Migration) []string {
	dropped := droppedTables(steps)
	var out []string
	for _, t := range dataTables {
		if dropped[t] {
			out = append(out, t)
		}
	}
	return out
}

// dataGuard is the printed revert's refusal, as Down's, to drop tables
// holding rows. It counts without a lock first, so that a revert it
// refuses queues behind no open transaction that read a table (holding
// off producers meanwhile); finding none, it locks each table, waiting at
// most 5 s unless the session bounds lock waits itself, and counts again,
// so that an event whose transaction commits meanwhile is counted, not
// dropped with its table. The lock_timeout holds for the rest of the
// transaction: the drops wait no longer.
func dataGuard(version int, tables []string) string {
	quoted := make([]string, len(tables))
	for i, t := range tables {
		quoted[i] = "'" + t + "'"
	}
	refuse := fmt.Sprintf(`RAISE EXCEPTION 'onceflow: refusing to revert migration %d: table %%.%% holds rows (pending events, dead letters, dedup records, idempotency keys, dead events'' write order or janitors'' windows): drain or export them first, or force it (onceflow migrate print --schema %% --version %d --down --force)', current_schema(), t, current_schema()`, version, version)
	// The rows that count (heldRows), per table.
	exists := `format('SELECT EXISTS (SELECT FROM %I)', t)`
	var when strings.Builder
	for _, t := range tables {
		if _, ok := heldRows[t]; ok {
			fmt.Fprintf(&when, " WHEN '%s' THEN '%s'", t, strings.ReplaceAll("SELECT EXISTS ("+heldRowsQuery(t, 1)+")", "'", "''"))
		}
	}
	if when.Len() > 0 {
		exists = "CASE t" + when.String() + " ELSE " + exists + " END"
	}
	return fmt.Sprintf(`-- Refuses, as onceflow migrate down does, to drop a table that holds rows.
DO $onceflow$
DECLARE
    t text;
    held boolean;
BEGIN
    -- The count after the lock must see what committed during the wait,
    -- which only READ COMMITTED does: under REPEATABLE READ an event
    -- committed meanwhile would be dropped with its table.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'onceflow: refusing to revert migration %[3]d under %% isolation: run it under READ COMMITTED (PGOPTIONS=''-c default_transaction_isolation=read\ committed''), so that its count sees the rows committed while it waits for the lock', current_setting('transaction_isolation');
    END IF;
    FOREACH t IN ARRAY ARRAY[%[1]s] LOOP
        IF to_regclass(t) IS NOT NULL THEN
            EXECUTE %[4]s INTO held;
            IF held THEN
                %[2]s;
            END IF;
        END IF;
    END LOOP;
    IF current_setting('lock_timeout') = '0' THEN
        PERFORM set_config('lock_timeout', '5s', true);
    END IF;
    FOREACH t IN ARRAY ARRAY[%[1]s] LOOP
        IF to_regclass(t) IS NOT NULL THEN
            BEGIN
                EXECUTE format('LOCK TABLE %%I IN ACCESS EXCLUSIVE MODE', t);
            EXCEPTION WHEN lock_not_available THEN
                RAISE EXCEPTION 'onceflow: gave up after %% waiting for a lock on %%.%% (the sessions that would use it queue behind the wait), held by %%: let those transactions end, or end them, and retry',
                    current_setting('lock_timeout'), current_schema(), t,
                    coalesce((SELECT string_agg(format('pid %%s (user %%s, application %%L, %%s)', a.pid, a.usename, a.application_name, a.state), '; ')
                        FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                        WHERE l.granted AND l.relation = to_regclass(t) AND l.pid <> pg_backend_pid()), 'sessions no longer there');
            END;
            EXECUTE %[4]s INTO held;
            IF held THEN
                %[2]s;
            END IF;
        END IF;
    END LOOP;
END $onceflow$;
`, strings.Join(quoted, ", "), refuse, version, exists)
}
