package migrations_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// helper 113: in exec mode (README's advice behind PgBouncer in
// transaction mode, and `onceflow migrate`'s own) PostgreSQL sends results
// as text, and under a DateStyle other than ISO (a legacy application's
// database or role setting, or a client's DateStyle that PgBouncer passes
// to every server connection) pgx could not read the timestamps the
// migrations read (the server's clock before each step, applied_at): Up,
// Down and List failed on an empty schema with pgx's "invalid date/time"
// error, applying nothing. `onceflow status` and `dead` already cope.
func TestMigrationsUnderANonISODateStyleInExecMode(t *testing.T) {
	t.Parallel()
	for _, style := range []string{"German", "SQL, DMY", "Postgres, MDY"} {
		t.Run(style, func(t *testing.T) {
			t.Parallel()
			pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) {
				cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
				cfg.ConnConfig.RuntimeParams["DateStyle"] = style
			})
			ctx := context.Background()
			var before string
			if err := pool.QueryRow(ctx, `SHOW DateStyle`).Scan(&before); err != nil {
				t.Fatal(err)
			}
			schema := pgtest.EmptySchema(t)
			all, _ := migrations.All()
			if applied, err := migrations.Up(ctx, pool, schema); err != nil || len(applied) != len(all) {
				t.Fatalf("Up: applied %v, %v", applied, err)
			}
			status, err := migrations.List(ctx, pool, schema)
			if err != nil {
				t.Fatalf("List: %v", err)
			}
			for _, s := range status {
				if s.AppliedAt == nil {
					t.Errorf("List: migration %d not applied", s.Version)
				}
			}
			if reverted, err := migrations.Down(ctx, pool, schema, 1); err != nil || len(reverted) != 1 {
				t.Fatalf("Down: reverted %v, %v", reverted, err)
			}
			var after string
			if err := pool.QueryRow(ctx, `SHOW DateStyle`).Scan(&after); err != nil || after != before {
				t.Fatalf("the session's DateStyle after the migrations: %q (%v), want %q kept", after, err, before)
			}
		})
	}
}
