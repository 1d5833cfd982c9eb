package migrations_test

import (
	"context"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// scratchDatabase creates a database of its own (its public schema is the
// point of the test, and the shared one's must stay untouched), drops it
// when the test ends, and returns a pool on it and its URL.
func scratchDatabase(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	ctx := context.Background()
	name := "oftest_db_" + filepath.Base(pgtest.EmptySchema(t))
	if _, err := pgtest.Pool(t).Exec(ctx, `CREATE DATABASE `+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Database = name
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pool.Close()
		if _, err := pgtest.Pool(t).Exec(context.Background(), `DROP DATABASE IF EXISTS `+pgx.Identifier{name}.Sanitize()+` WITH (FORCE)`); err != nil {
			t.Error(err)
		}
	})
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	return pool, u.String()
}

// A revert never reaches past its schema: a down step whose tables are not
// in the schema (a mistyped --schema, a step printed twice, tables dropped
// by hand) must not find the public schema's tables of the same names.
// The printed down script, applied by psql (which goes on after an error),
// dropped public's outbox and processed_messages; Down on a schema missing
// a table dropped public's.
func TestARevertNeverReachesPublic(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, dbURL := scratchDatabase(t)
	if _, err := migrations.Up(ctx, pool, "public"); err != nil {
		t.Fatal(err)
	}
	publicTables := func() int {
		t.Helper()
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = 'public'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	want := publicTables()

	// The printed script for a schema that does not exist, then for one
	// whose step was already reverted.
	psql, err := exec.LookPath("psql")
	if err != nil {
		t.Fatalf("psql (Debian's postgresql-client) is needed to apply the script as users do: %v", err)
	}
	reverted := "oftest_reverted"
	if _, err := migrations.Up(ctx, pool, reverted); err != nil {
		t.Fatal(err)
	}
	if _, err := migrations.DownForce(ctx, pool, reverted, migrations.Latest()); err != nil {
		t.Fatal(err)
	}
	for _, schema := range []string{"oftest_mistyped", reverted} {
		script, err := migrations.Script(schema, 1, true)
		if err != nil {
			t.Fatal(err)
		}
		file := filepath.Join(t.TempDir(), "down.sql")
		if err := os.WriteFile(file, []byte(script), 0o600); err != nil {
			t.Fatal(err)
		}
		out, _ := exec.Command(psql, "--no-psqlrc", "-d", dbURL, "-f", file).CombinedOutput()
		if got := publicTables(); got != want {
			t.Fatalf("the down script for schema %s left %d tables of %d in public; psql said:\n%s", schema, got, want, out)
		}
	}

	// Down on a schema that lost a table by hand.
	drifted := "oftest_drifted"
	if _, err := migrations.Up(ctx, pool, drifted); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `DROP TABLE `+pgx.Identifier{drifted, "processed_messages"}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	if _, err := migrations.DownForce(ctx, pool, drifted, migrations.Latest()); err != nil {
		t.Fatal(err)
	}
	if got := publicTables(); got != want {
		t.Fatalf("DownForce of schema %s left %d tables of %d in public", drifted, got, want)
	}
}
