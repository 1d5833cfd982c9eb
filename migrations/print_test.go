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
	if !errors.As(err, &missing) || !strings.Contains(err.Error(), "migrate print") {
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
