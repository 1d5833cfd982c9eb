package migrations_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// applyBareFiles applies the up files of migrations 1 to n to schema as
// another migration tool does from a copy of migrations/*.sql: each with
// search_path set to the schema, recording nothing in schema_migrations.
func applyBareFiles(t *testing.T, schema string, n int) {
	t.Helper()
	all, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	ident := pgx.Identifier{schema}.Sanitize()
	sql := `CREATE SCHEMA IF NOT EXISTS ` + ident + `; SET search_path TO ` + ident + `, public;`
	for _, m := range all[:n] {
		sql += "\n" + m.Up + ";"
	}
	execScript(t, sql)
}

// recordSQL returns the SQL err's advice gives to record the versions
// applied by hand (the text between backquotes that creates the version
// table), with the newest version applied, n, in place of its <N>.
func recordSQL(t *testing.T, err error, n int) string {
	t.Helper()
	parts := strings.Split(err.Error(), "`")
	for i := 1; i < len(parts); i += 2 {
		if strings.HasPrefix(parts[i], "BEGIN; CREATE TABLE") {
			if !strings.Contains(parts[i], "<N>") {
				t.Fatalf("the SQL in %q has no <N> for the operator to fill in", err)
			}
			return strings.ReplaceAll(parts[i], "<N>", strconv.Itoa(n))
		}
	}
	t.Fatalf("%q gives no SQL that creates the version table", err)
	return ""
}

// A schema whose tables another tool applied from the bare files has no
// version table. Check's advice for it was to apply `onceflow migrate
// print` output or run `onceflow migrate up`, and both failed: relation
// "outbox" already exists. Up refuses it with Check's advice, changing
// nothing; the advice, followed, records the versions applied, and Up
// then applies the rest.
func TestHandAppliedTablesAdviceWorks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.EmptySchema(t)
	applyBareFiles(t, schema, 5)

	var missing *migrations.MissingError
	checkErr := migrations.Check(ctx, pool, schema)
	if !errors.As(checkErr, &missing) || !missing.NoVersionTable || !missing.Tables {
		t.Fatalf("Check on hand-applied tables: %v", checkErr)
	}
	applied, err := migrations.Up(ctx, pool, schema)
	if !errors.As(err, &missing) || len(applied) != 0 || err.Error() != checkErr.Error() {
		t.Fatalf("Up on hand-applied tables: applied %v, err %v; want Check's advice", applied, err)
	}
	if tableExists(t, schema, "schema_migrations") {
		t.Fatal("the refused Up created schema_migrations")
	}

	execScript(t, recordSQL(t, checkErr, 5))
	if applied, err := migrations.Up(ctx, pool, schema); err != nil || len(applied) != migrations.Latest()-5 || applied[0] != 6 {
		t.Fatalf("Up after following the advice: applied %v, err %v; want 6 on", applied, err)
	}
	if err := migrations.Check(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	list, err := migrations.List(ctx, pool, schema)
	if err != nil || len(list) != migrations.Latest() {
		t.Fatalf("List: %v, %v", list, err)
	}
	for _, s := range list {
		if s.AppliedAt == nil {
			t.Errorf("migration %d not recorded", s.Version)
		}
	}
}
