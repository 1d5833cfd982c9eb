package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

// helper 118: README says a long lock on the outbox (VACUUM FULL, CLUSTER,
// a migration) pauses the relays' rounds, not their leases. /livez failed
// once the publish loop had not passed for its stall time, so the
// documented probe restarted every relay a few minutes into such a lock,
// and again after each restart, into CrashLoopBackOff: a restart does not
// end a lock. A loop stalled while one of the relay's own sessions waits
// on a lock is waiting on purpose.
func TestLivezPassesWhileTheLoopWaitsOnAnOutboxLock(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	backends := &backendPIDs{}
	pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) { backends.install(cfg) })
	k := kafkatest.New(t)
	pub, err := kgopublisher.New(k.Brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	r, err := relay.New(pool, pub, &relay.Config{Schema: schema, PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() { stop(); <-done }()

	p := &probes{pool: pool, watch: &brokerWatch{}, stallAt: time.Second, backends: backends, schema: schema}
	p.relay.Store(r)
	livez := func() (int, string) {
		rec := httptest.NewRecorder()
		p.livez(rec, httptest.NewRequest(http.MethodGet, "/livez", nil))
		return rec.Code, rec.Body.String()
	}
	waitUntil(t, "the publish loop to pass", 10*time.Second, func() bool { return !r.LastLoop().IsZero() })

	lock, err := pgtest.Pool(t).Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback(context.Background()) }()
	if _, err := lock.Exec(context.Background(), `LOCK TABLE `+pgx.Identifier{schema, "outbox"}.Sanitize()+` IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the loop to stall past /livez's stall time", 10*time.Second, func() bool { return time.Since(r.LastLoop()) > 2*time.Second })
	if code, body := livez(); code != http.StatusOK {
		t.Fatalf("/livez while the loop waits on a lock on the outbox: %d %q, want 200", code, strings.TrimSpace(body))
	}
	_ = lock.Rollback(context.Background())
	waitUntil(t, "the loop to pass again", 10*time.Second, func() bool { return time.Since(r.LastLoop()) < time.Second })
}

// helper 119: the lock check asked pg_stat_activity, which hides the wait
// columns of sessions logged in as another role than the viewer's
// effective one (a relay logging in as a user with `-c role=…`), so the
// check said no; and it counted any lock wait of any session of the pool,
// the row-lock waits the relay's statements have by design (seconds at
// most) too, which could answer 200 for a loop stuck for another reason.
// It asks pg_locks (not filtered by role) for a table lock of the schema.
func TestLivezLockCheckSeesTableLocksOnlyUnderAnyRole(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	admin := pgtest.Pool(t)
	ctx := context.Background()
	suffix := strings.TrimPrefix(schema, "oftest_")
	login, effective := "oflogin_"+suffix, "ofrole_"+suffix
	for _, sql := range []string{
		`CREATE ROLE ` + effective,
		`CREATE ROLE ` + login + ` LOGIN IN ROLE ` + effective,
		`GRANT USAGE ON SCHEMA ` + schema + ` TO ` + effective,
		`GRANT SELECT, UPDATE ON ` + schema + `.outbox TO ` + effective,
	} {
		if _, err := admin.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, sql := range []string{`DROP OWNED BY ` + login + `, ` + effective, `DROP ROLE ` + login, `DROP ROLE ` + effective} {
			_, _ = admin.Exec(context.Background(), sql)
		}
	})
	backends := &backendPIDs{}
	pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.User = login
		cfg.ConnConfig.RuntimeParams["role"] = effective
		backends.install(cfg)
	})
	p := &probes{pool: pool, watch: &brokerWatch{}, stallAt: time.Second, backends: backends, schema: schema}
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := admin.Exec(ctx, `INSERT INTO `+outbox+` (topic, value) VALUES ('t', 'v')`); err != nil {
		t.Fatal(err)
	}

	// A row lock: the relay's own statements wait on those by design.
	rowTx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rowTx.Exec(ctx, `SELECT FROM `+outbox+` FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	waiting := make(chan error, 2)
	go func() {
		_, err := pool.Exec(ctx, `UPDATE `+outbox+` SET attempts = attempts`)
		waiting <- err
	}()
	waitUntil(t, "the pool's session to wait on the row", 10*time.Second, func() bool {
		var n int
		_ = admin.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE pid = ANY($1::int8[]) AND NOT granted`, backends.list()).Scan(&n)
		return n > 0
	})
	if p.waitsOnLock(ctx) {
		t.Errorf("a session waiting on a row lock counts as waiting on a table lock")
	}
	_ = rowTx.Rollback(ctx)
	if err := <-waiting; err != nil {
		t.Fatal(err)
	}

	// A table lock (VACUUM FULL, CLUSTER, a migration), seen whatever the
	// session's role.
	tableTx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tableTx.Rollback(ctx) }()
	if _, err := tableTx.Exec(ctx, `LOCK TABLE `+outbox+` IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	go func() {
		_, err := pool.Exec(ctx, `SELECT count(*) FROM `+outbox)
		waiting <- err
	}()
	waitUntil(t, "the pool's session to wait on the table", 10*time.Second, func() bool {
		var n int
		_ = admin.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE pid = ANY($1::int8[]) AND NOT granted`, backends.list()).Scan(&n)
		return n > 0
	})
	if !p.waitsOnLock(ctx) {
		t.Errorf("a session logged in as %s under role %s waiting on a lock of the outbox is not seen", login, effective)
	}
	_ = tableTx.Rollback(ctx)
	if err := <-waiting; err != nil {
		t.Fatal(err)
	}
}
