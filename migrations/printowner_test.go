package migrations_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// README, "Roles and privileges": the migrator needs CREATE on the
// database, "or [to own] a schema an administrator created (`CREATE
// SCHEMA onceflow AUTHORIZATION migrator`)". `onceflow migrate up` works
// for such a role (it creates the schema only when it is missing), but the
// script `onceflow migrate print` gives "your own migration tool" started
// with an unconditional `CREATE SCHEMA IF NOT EXISTS`, which PostgreSQL
// refuses without CREATE on the database even when the schema exists:
// "permission denied for database", nothing applied. The script now, like
// Up, creates the schema and its version table only when missing. h97.
func TestPrintedScriptAppliesForARoleThatOwnsThePrecreatedSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := pgtest.EmptySchema(t)
	pool := pgtest.RolePool(t, schema, `CREATE SCHEMA {s} AUTHORIZATION {role}`)
	var canCreate bool
	if err := pool.QueryRow(ctx, `SELECT has_database_privilege(current_database(), 'CREATE')`).Scan(&canCreate); err != nil || canCreate {
		t.Skipf("the role may create schemas in this database (err %v): nothing to show", err)
	}
	script, err := migrations.Script(schema, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := tx.Conn().PgConn().Exec(ctx, script).ReadAll()
		return err
	})
	if err != nil {
		t.Fatalf("the printed script, applied by the schema's owner, failed: %v", err)
	}
	if err := migrations.Check(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
}

// The same role migrates with Up: the README's promise holds there.
func TestUpAppliesForARoleThatOwnsThePrecreatedSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := pgtest.EmptySchema(t)
	pool := pgtest.RolePool(t, schema, `CREATE SCHEMA {s} AUTHORIZATION {role}`)
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
}
