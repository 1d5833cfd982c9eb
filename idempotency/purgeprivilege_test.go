package idempotency_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// A purger whose role lacks a privilege it needs (UPDATE on
// idempotency_keys: the purge locks the rows it deletes) says so at Error,
// to slog's default logger unless given one: it warned to a logger that
// discarded it by default, every interval, while the table grew without
// end (helper 76). It goes on, and purges once granted.
func TestAPurgerWithoutItsPrivilegesSaysSoAndPurgesOnceGranted(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	table := pgx.Identifier{schema, "idempotency_keys"}.Sanitize()
	pool := pgtest.RolePool(t, schema,
		`GRANT USAGE ON SCHEMA {s} TO {role}`,
		`GRANT SELECT, INSERT, DELETE ON {s}.idempotency_keys TO {role}`) // no UPDATE
	ctx := context.Background()
	if _, err := pgtest.Pool(t).Exec(ctx, `INSERT INTO `+table+` (scope, key, fingerprint, state, token, body, expires_at)
VALUES ('do:default', 'k', '', 'done', gen_random_uuid(), 'stale', now() - interval '1 second')`); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var logs bytes.Buffer
	logged := func() string { mu.Lock(); defer mu.Unlock(); return logs.String() }
	w := writerFunc(func(p []byte) (int, error) { mu.Lock(); defer mu.Unlock(); return logs.Write(p) })
	p, err := idempotency.NewPurger(pool, &idempotency.PurgeConfig{Schema: schema, Interval: time.Second, Logger: slog.New(slog.NewTextHandler(w, nil))})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- p.Run(runCtx) }()
	defer func() { cancel(); <-done }()
	waitFor(t, 10*time.Second, "the refusal logged at Error", func() bool {
		return strings.Contains(logged(), "level=ERROR") && strings.Contains(logged(), "permission denied")
	})
	if _, err := pgtest.Pool(t).Exec(ctx, `GRANT UPDATE ON `+table+` TO `+pool.Config().ConnConfig.User); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the expired record purged once granted", func() bool {
		var n int
		if err := pgtest.Pool(t).QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
