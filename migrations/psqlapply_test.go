package migrations_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// psqlApply runs a printed script through psql as the script's first
// lines and `migrate print --help` tell users to: one transaction (-1),
// stopping at the first error.
func psqlApply(t *testing.T, script string) (string, error) {
	t.Helper()
	psql, err := exec.LookPath("psql")
	if err != nil {
		t.Fatalf("psql (Debian's postgresql-client) is needed to apply the script as users do: %v", err)
	}
	file := filepath.Join(t.TempDir(), "up.sql")
	if err := os.WriteFile(file, []byte(script), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(psql, "--no-psqlrc", "-1", "-v", "ON_ERROR_STOP=1", "-d", pgtest.URL(t), "-f", file).CombinedOutput()
	return string(out), err
}

// TestPrintedScriptAppliesWithPsql: the printed up script, whole or one
// version at a time, applies with psql as documented. Migration 7 locks the
// outbox (LOCK TABLE), which PostgreSQL refuses outside a transaction
// block: applied with plain psql, as the help suggested, psql with
// ON_ERROR_STOP stopped there with versions 1-6 recorded, and without it
// skipped the lock and recorded 7 anyway. The script and the help now say
// to apply it in one transaction (psql -1), and a failed step then records
// nothing.
func TestPrintedScriptAppliesWithPsql(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	whole := pgtest.EmptySchema(t)
	script, err := migrations.Script(whole, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := psqlApply(t, script); err != nil {
		t.Fatalf("psql on the whole up script: %v\n%s", err, out)
	}
	if err := migrations.Check(ctx, pool, whole); err != nil {
		t.Fatalf("Check after psql applied the whole script: %v", err)
	}

	stepwise := pgtest.EmptySchema(t)
	for v := 1; v <= migrations.Latest(); v++ {
		s, err := migrations.Script(stepwise, v, false)
		if err != nil {
			t.Fatal(err)
		}
		if out, err := psqlApply(t, s); err != nil {
			t.Fatalf("psql on version %d's up script: %v\n%s", v, err, out)
		}
	}
	if err := migrations.Check(ctx, pool, stepwise); err != nil {
		t.Fatalf("Check after psql applied each version: %v", err)
	}

	// A step that fails (a table of that name is already there) records
	// nothing, the steps before it included.
	failing := pgtest.EmptySchema(t)
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+failing+`; CREATE TABLE `+failing+`.relay_shards (x int)`); err != nil {
		t.Fatal(err)
	}
	script, err = migrations.Script(failing, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := psqlApply(t, script); err == nil {
		t.Fatalf("psql applied a script whose first step must fail:\n%s", out)
	}
	var recorded bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, failing+".schema_migrations").Scan(&recorded); err != nil || recorded {
		t.Fatalf("after a failed step, %s.schema_migrations exists: %v (err %v); want nothing recorded", failing, recorded, err)
	}
}

// TestPrintedScriptRunsInsideAToolsTransaction: a migration tool runs each
// file inside a transaction of its own and records its version after it.
// The script must neither end that transaction (a COMMIT of its own would:
// the tool's ROLLBACK or its version row would then act on nothing) nor
// leave the tool's search_path changed.
func TestPrintedScriptRunsInsideAToolsTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn := pgtest.Conn(t)
	schema := pgtest.EmptySchema(t)
	script, err := migrations.Script(schema, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `SET search_path TO pg_catalog, public`); err != nil {
		t.Fatal(err)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, script); err != nil {
		t.Fatalf("the script inside a transaction: %v", err)
	}
	var searchPath string
	if err := tx.QueryRow(ctx, `SHOW search_path`).Scan(&searchPath); err != nil || searchPath != "pg_catalog, public" {
		t.Fatalf("search_path after the script: %q (err %v), want the caller's pg_catalog, public", searchPath, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("the tool's rollback: %v (the script ended its transaction?)", err)
	}
	var kept bool
	if err := conn.QueryRow(ctx, `SELECT to_regnamespace($1) IS NOT NULL`, schema).Scan(&kept); err != nil || kept {
		t.Fatalf("schema %s kept after the tool's rollback: %v (err %v): the script committed on its own", schema, kept, err)
	}
}
