package relay_test

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
)

// dbProxy forwards TCP connections to the test database until down is
// called: then it cuts every open connection and refuses new ones (accepts
// and closes them at once) until up is called. It stands in for a database
// outage without touching the shared server.
type dbProxy struct {
	ln     net.Listener
	target string
	isDown atomic.Bool

	mu    sync.Mutex
	conns map[net.Conn]bool
}

func newDBProxy(t *testing.T) (*dbProxy, string) {
	t.Helper()
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &dbProxy{ln: ln, target: u.Host, conns: map[net.Conn]bool{}}
	go p.serve()
	t.Cleanup(func() { ln.Close(); p.down() })
	u.Host = ln.Addr().String()
	return p, u.String()
}

func (p *dbProxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if p.isDown.Load() {
			c.Close()
			continue
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns[c], p.conns[s] = true, true
		p.mu.Unlock()
		go func() { _, _ = io.Copy(s, c); s.Close(); c.Close() }()
		go func() { _, _ = io.Copy(c, s); s.Close(); c.Close() }()
	}
}

func (p *dbProxy) down() {
	p.isDown.Store(true)
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
	}
	clear(p.conns)
}

func (p *dbProxy) up() { p.isDown.Store(false) }

// shardsObserver keeps the last owned-shards figure the relay reported.
type shardsObserver struct{ owned atomic.Int64 }

func (*shardsObserver) ObserveBatch(relay.BatchStats) {}
func (o *shardsObserver) ObserveShards(n int)         { o.owned.Store(int64(n)) }

// While the database is unreachable the relay's leases lapse: the owned
// shards it reports drop to zero (an operator sees no shard owned, not a
// stale 256), and come back once the database does.
func TestOwnedShardsDropWhenLeasesLapseInAnOutage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy, dbURL := newDBProxy(t)
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	obs := &shardsObserver{}
	log, logs := newLogger(slog.LevelInfo)
	b.startRelayOn(t, pool, relay.Config{Observer: obs, LeaseDuration: 900 * time.Millisecond, Logger: log})
	waitFor(t, "the relay to own every shard", 30*time.Second, func() bool { return obs.owned.Load() == relay.NumShards })

	proxy.down()
	waitFor(t, "owned shards to drop to 0 while the database is down", 30*time.Second, func() bool { return obs.owned.Load() == 0 })

	proxy.up()
	waitFor(t, "owned shards back after the database returned", 60*time.Second, func() bool { return obs.owned.Load() == relay.NumShards })

	// The lapse is a warning; the recovery is logged at Info.
	waitFor(t, "the recovery in the log", 30*time.Second, func() bool {
		return len(logs.lines(`level=INFO msg="relay: lease upkeep recovered" instance=\S+ shards=`)) > 0
	})
	if len(logs.lines(`level=WARN msg="relay: shard leases lapsed; publishing paused until the database answers" instance=\S+ shards=256`)) == 0 {
		t.Errorf("the lapse was not logged:\n%s", logs.String())
	}
	checkVocabulary(t, logs)
}
