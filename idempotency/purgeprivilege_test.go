package idempotency_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// A purger whose role lacks a privilege it needs (UPDATE on
// idempotency_keys: the purge locks the rows it deletes) returns an error
// from Run saying so, rather than logging a warning (to a logger that
// discarded it by default) every interval while the table grows without
// end (helper 76).
func TestAPurgerWithoutItsPrivilegesStopsAndSaysSo(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	pool := pgtest.RolePool(t, schema,
		`GRANT USAGE ON SCHEMA {s} TO {role}`,
		`GRANT SELECT, INSERT, DELETE ON {s}.idempotency_keys TO {role}`) // no UPDATE
	p, err := idempotency.NewPurger(pool, &idempotency.PurgeConfig{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = p.Run(ctx)
	if ctx.Err() != nil || err == nil || !strings.Contains(err.Error(), "permission denied") {
		t.Fatalf("Run returned %v (context: %v), want the refusal at once", err, ctx.Err())
	}
}
