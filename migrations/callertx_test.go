package migrations_test

import (
	"context"
	"testing"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// Up called inside a caller's own transaction (a migration tool that hands
// onceflow its pgx.Tx) leaves the transaction's settings as it found them:
// the caller's transaction kept onceflow's 5s lock_timeout and its
// search_path for its own later steps (helper 94).
func TestUpInACallersTransactionLeavesItsSettings(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.EmptySchema(t)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	settings := func() (lockTimeout, searchPath string) {
		t.Helper()
		if err := tx.QueryRow(ctx, `SELECT current_setting('lock_timeout'), current_setting('search_path')`).Scan(&lockTimeout, &searchPath); err != nil {
			t.Fatal(err)
		}
		return lockTimeout, searchPath
	}
	lockBefore, pathBefore := settings()
	if _, err := migrations.Up(ctx, tx, schema); err != nil {
		t.Fatal(err)
	}
	lockAfter, pathAfter := settings()
	if lockAfter != lockBefore || pathAfter != pathBefore {
		t.Errorf("after Up in the caller's transaction: lock_timeout %q, search_path %q; want them as before, %q and %q", lockAfter, pathAfter, lockBefore, pathBefore)
	}
}
