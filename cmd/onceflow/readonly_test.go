package main

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/internal/proctest"
)

// A relay whose database refuses writes (a hot standby, a reader endpoint,
// default_transaction_read_only on for its role) takes no shard and
// publishes nothing: its first lease round fails with SQLSTATE 25006 and
// is retried, as after a failover, until writes are accepted. /readyz
// answered 200 meanwhile (the database answered a ping, a broker the
// check), so a rollout onto a standby went through and `kubectl get pods`
// showed a relay doing its job. /readyz now says the database is
// read-only, and the wait's log line names it.
func TestARelayOnAReadOnlyDatabaseIsNotReady(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	pool := pgtest.RolePool(t, schema,
		`GRANT USAGE ON SCHEMA {s} TO {role}`,
		`GRANT ALL ON ALL TABLES IN SCHEMA {s} TO {role}`,
		`GRANT ALL ON ALL SEQUENCES IN SCHEMA {s} TO {role}`,
		`ALTER ROLE {role} SET default_transaction_read_only = on`)
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(pool.Config().ConnConfig.User)
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	addr := freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	var log proctest.Buffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"relay", "--database-url", u.String(), "--schema", schema,
			"--brokers", strings.Join(c.ListenAddrs(), ","), "--http-addr", addr,
			"--kafka-check-interval", "200ms", "--lease-duration", "1s"}, &log, &log)
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("relay: %v\n%s", err, log.String())
		}
	}()
	waitUntil(t, "the relay's first lease round to fail", 20*time.Second, func() bool {
		return strings.Contains(log.String(), "read-only transaction")
	})
	var code int
	var body string
	waitUntil(t, "/readyz to answer", 10*time.Second, func() bool {
		code, body = httpGet("http://" + addr + "/readyz")
		return code != 0 && !strings.Contains(body, "kafka unreachable")
	})
	if code != 503 || !strings.Contains(body, "database read-only") {
		t.Errorf("/readyz of a relay on a read-only database: %d %q, want 503 naming it", code, body)
	}
	if !strings.Contains(log.String(), "read-only (a hot standby") {
		t.Errorf("the relay's wait does not say the database is read-only:\n%s", log.String())
	}
}
