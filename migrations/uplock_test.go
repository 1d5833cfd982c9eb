package migrations_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// Up, like Down, waits a bounded time for a table lock a step needs: an
// upgrade (migrations 6 on pending) behind an open transaction that read
// the outbox (a psql session) waited with no timeout for the outbox's
// ACCESS EXCLUSIVE lock, and every producer's insert queued behind its
// request. It gives up after DefaultLockTimeout (5 s), names the session
// that holds the table and applies nothing: the pending steps are one
// transaction.
func TestUpGivesUpOnALockItCannotGet(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.Schema(t)
	revertTo(t, schema, 5) // the schema as an older release left it
	openReader(t, schema)
	quick, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	start := time.Now()
	applied, err := migrations.Up(quick, pool, schema)
	waited := time.Since(start)
	if err == nil || len(applied) != 0 || quick.Err() != nil || !strings.Contains(err.Error(), openReaderApp) || !strings.Contains(err.Error(), "outbox") {
		t.Fatalf("Up behind an open reader: applied %v, err %v after %s; want a failure naming the reader", applied, err, waited.Round(time.Millisecond))
	}
	if waited < migrations.DefaultLockTimeout || waited > migrations.DefaultLockTimeout+5*time.Second {
		t.Errorf("Up gave up after %s, want about DefaultLockTimeout (%s)", waited, migrations.DefaultLockTimeout)
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
		t.Errorf("Up's error %v does not wrap lock_not_available", err)
	}
	assertAppliedThrough(t, schema, 5)
}

// assertAppliedThrough fails unless schema records exactly the versions 1
// to n and holds nothing migration 6 creates (its domain outbox_topic).
func assertAppliedThrough(t *testing.T, schema string, n int) {
	t.Helper()
	list, err := migrations.List(context.Background(), pgtest.Pool(t), schema)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range list {
		if (s.AppliedAt != nil) != (s.Version <= n) {
			t.Errorf("migration %d applied %v, want the schema at %d exactly", s.Version, s.AppliedAt != nil, n)
		}
	}
	var domain bool
	if err := pgtest.Pool(t).QueryRow(context.Background(), `SELECT to_regtype($1) IS NOT NULL`, pgx.Identifier{schema, "outbox_topic"}.Sanitize()).Scan(&domain); err != nil {
		t.Fatal(err)
	}
	if domain != (n >= 6) {
		t.Errorf("domain outbox_topic exists: %v, want the schema at %d exactly (nothing half-applied)", domain, n)
	}
}

// UpWith sets the bound, and takes none PostgreSQL would refuse; the
// session's own lock_timeout (a URL's ?lock_timeout=) is replaced for the
// migration only.
func TestUpWithALockTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := pgtest.Schema(t)
	revertTo(t, schema, 5)
	openReader(t, schema)
	conn := pgtest.Conn(t)
	if _, err := conn.Exec(ctx, `SET lock_timeout = '1min'`); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	applied, err := migrations.UpWith(ctx, conn, schema, &migrations.UpConfig{LockTimeout: 300 * time.Millisecond})
	if waited := time.Since(start); err == nil || len(applied) != 0 || !strings.Contains(err.Error(), openReaderApp) ||
		!strings.Contains(err.Error(), "UpConfig.LockTimeout") || waited > 5*time.Second {
		t.Fatalf("UpWith(LockTimeout 300ms) behind an open reader: applied %v, err %v after %s", applied, err, waited)
	}
	var setting string
	if err := conn.QueryRow(ctx, `SHOW lock_timeout`).Scan(&setting); err != nil || setting != "1min" {
		t.Errorf("the session's lock_timeout after UpWith: %q (err %v), want its own 1min back", setting, err)
	}
	assertAppliedThrough(t, schema, 5)
	for _, bad := range []time.Duration{-time.Second, time.Microsecond, 25 * 24 * time.Hour} {
		if _, err := migrations.UpWith(ctx, conn, schema, &migrations.UpConfig{LockTimeout: bad}); err == nil || !strings.Contains(err.Error(), "UpConfig.LockTimeout") {
			t.Errorf("UpWith(LockTimeout %s): %v; want a refusal naming UpConfig.LockTimeout", bad, err)
		}
	}
}
