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

	p := &probes{pool: pool, watch: &brokerWatch{}, stallAt: time.Second, backends: backends}
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
