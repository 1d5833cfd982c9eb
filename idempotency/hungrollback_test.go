package idempotency_test

import (
	"context"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// blackHoleConn is a database connection whose way to the server can go
// silent: once cut, what the client writes is lost and nothing comes
// back, while the socket stays open (a NAT or firewall that dropped the
// flow, a server host frozen). A read then waits for its deadline.
type blackHoleConn struct {
	net.Conn
	cut atomic.Bool
}

func (c *blackHoleConn) Write(p []byte) (int, error) {
	if c.cut.Load() {
		return len(p), nil
	}
	return c.Conn.Write(p)
}

// Transactional mode rolls a failed request's transaction back before it
// sends the handler's 5xx, with no deadline (the client may have left, so
// not under the request's context either). On a connection gone silent
// the rollback waited for good (the server's socket is alive, so TCP
// keepalive sees nothing wrong), and with it the client's answer and the
// handler's goroutine. The rollback is bounded: the connection is then
// closed, and the server rolls back when it notices.
func TestTransactionalRollbackOnASilentConnectionDoesNotHoldTheAnswer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var mu sync.Mutex
	var conns []net.Conn
	pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			return &blackHoleConn{Conn: c}, nil
		}
	})
	srv := newServer(t, bundle{pool: pool, schema: b.schema}, idempotency.Config{Mode: idempotency.Transactional}, func(w http.ResponseWriter, r *http.Request) {
		if err := writeEffect(r.Context(), pool, b.schema, "charged"); err != nil {
			t.Error(err)
		}
		// The way to the database goes silent, and the downstream fails.
		idempotency.Tx(r.Context()).Conn().PgConn().Conn().(*blackHoleConn).cut.Store(true)
		http.Error(w, "gateway timeout", http.StatusBadGateway)
	})
	t.Cleanup(func() { // before the server's Close: a handler still held would hold it
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	client := &http.Client{Timeout: 20 * time.Second}
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader("{}"))
	req.Header.Set(idempotency.KeyHeader, "k-silent")
	req.Header.Set("X-User", "alice")
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("no answer within 20 s of a request whose rollback met a silent connection: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("status %d, want the handler's 502", resp.StatusCode)
	}
	t.Logf("answered in %s", time.Since(start).Round(time.Millisecond))
	// The server rolls the transaction back once the connection is closed.
	waitFor(t, 10*time.Second, "the effect to be rolled back", func() bool { return b.effects(t) == 0 })
}
