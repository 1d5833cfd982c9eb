package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// RolePool creates a login role, runs grants for it (each a statement in
// which {s} stands for schema, quoted, and {role} for the role), and
// returns a pool connecting as it: a service running with only the
// privileges README's "Roles and privileges" gives it. The role and its
// privileges are dropped when the test ends. The test server must let any
// role in (trust on 127.0.0.1, as the tests' PostgreSQL does).
func RolePool(t testing.TB, schema string, grants ...string) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	admin := Pool(t)
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	role := "oftest_role_" + hex.EncodeToString(b)
	if _, err := admin.Exec(ctx, `CREATE ROLE `+role+` LOGIN`); err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = admin.Exec(context.Background(), `DROP ROLE `+role)
	})
	r := strings.NewReplacer("{s}", pgx.Identifier{schema}.Sanitize(), "{role}", role)
	for _, g := range grants {
		if _, err := admin.Exec(ctx, r.Replace(g)); err != nil {
			t.Fatalf("pgtest: %s: %v", r.Replace(g), err)
		}
	}
	cfg, err := pgxpool.ParseConfig(URL(t))
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	cfg.ConnConfig.User = role
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(p.Close)
	return p
}
