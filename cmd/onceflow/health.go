package main

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/relay"
)

// brokerWatch checks every interval that a Kafka broker answers. A relay's
// Publish never fails for an unreachable broker (it waits, G7), so without
// this a wrong address or a cluster outage showed nowhere. It logs the loss
// at once and then at most every warnEvery while it lasts (Warn), the
// recovery (Info), and a publish round that Kafka has not acknowledged for
// warnEvery while the brokers do answer (advertised listeners, ACLs, ISR);
// it exports onceflow_relay_kafka_up, onceflow_relay_kafka_check_failures_total
// and onceflow_relay_publish_waiting_seconds.
type brokerWatch struct {
	relay.Publisher
	ping      func(context.Context) error
	log       *slog.Logger
	interval  time.Duration
	warnEvery time.Duration

	up      atomic.Bool
	checked atomic.Bool

	// The start of each Publish in flight: a side retry runs beside the
	// rounds, and the one that ends first must not hide the other.
	inFlightMu sync.Mutex
	inFlight   map[uint64]time.Time
	nextCall   uint64

	upGauge  prometheus.Gauge
	failures prometheus.Counter
}

// newBrokerWatch wraps pub (Publish calls are timed) and registers the
// metrics in reg.
func newBrokerWatch(pub relay.Publisher, log *slog.Logger, reg prometheus.Registerer, interval time.Duration) *brokerWatch {
	w := &brokerWatch{Publisher: pub, log: log, interval: interval, warnEvery: 30 * time.Second, inFlight: map[uint64]time.Time{}}
	if p, ok := pub.(interface{ Ping(context.Context) error }); ok {
		w.ping = p.Ping
	} else {
		w.ping = func(context.Context) error { return nil }
	}
	w.upGauge = prometheus.NewGauge(prometheus.GaugeOpts{Name: "onceflow_relay_kafka_up",
		Help: "1 if a Kafka broker answered the relay's last check (every --kafka-check-interval), 0 if none did."})
	w.failures = prometheus.NewCounter(prometheus.CounterOpts{Name: "onceflow_relay_kafka_check_failures_total",
		Help: "Checks in which no Kafka broker answered."})
	waiting := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "onceflow_relay_publish_waiting_seconds",
		Help: "How long the oldest publish in flight (a round or a side retry) has waited for Kafka's acknowledgements; 0 when none is in flight."},
		func() float64 { return w.waiting().Seconds() })
	reg.MustRegister(w.upGauge, w.failures, waiting)
	return w
}

// Publish times the call, for the stuck-round warning and /livez.
func (w *brokerWatch) Publish(ctx context.Context, records []relay.Record) []error {
	w.inFlightMu.Lock()
	call := w.nextCall
	w.nextCall++
	w.inFlight[call] = time.Now()
	w.inFlightMu.Unlock()
	defer func() {
		w.inFlightMu.Lock()
		delete(w.inFlight, call)
		w.inFlightMu.Unlock()
	}()
	return w.Publisher.Publish(ctx, records)
}

// Partition passes relay.PartitionReporter through: the relay asks its
// publisher for it, and without it a refusing partition is learned one key
// at a time (every round waiting out the publish timeout) and the held-keys
// cap stops every partition instead of the sick one.
func (w *brokerWatch) Partition(topic string, key []byte) (int32, bool) {
	if p, ok := w.Publisher.(relay.PartitionReporter); ok {
		return p.Partition(topic, key)
	}
	return 0, false
}

var _ relay.PartitionReporter = (*brokerWatch)(nil)

// Ping passes the publisher's on: the relay pings to learn whether it
// reaches Kafka (Config.KafkaHandoff).
func (w *brokerWatch) Ping(ctx context.Context) error { return w.ping(ctx) }

// waiting is how long the oldest Publish in flight has waited; 0 when none is.
func (w *brokerWatch) waiting() time.Duration {
	w.inFlightMu.Lock()
	defer w.inFlightMu.Unlock()
	var oldest time.Time
	for _, start := range w.inFlight {
		if oldest.IsZero() || start.Before(oldest) {
			oldest = start
		}
	}
	if oldest.IsZero() {
		return 0
	}
	return time.Since(oldest)
}

// reachable reports the last check's outcome; true before the first.
func (w *brokerWatch) reachable() bool { return !w.checked.Load() || w.up.Load() }

func (w *brokerWatch) run(ctx context.Context) {
	var downSince, lastWarn, lastStuck time.Time
	t := time.NewTicker(w.interval)
	defer t.Stop()
	for {
		pingCtx, cancel := context.WithTimeout(ctx, max(w.interval, 5*time.Second))
		err := w.ping(pingCtx)
		cancel()
		if ctx.Err() != nil {
			return
		}
		now := time.Now()
		switch {
		case err != nil:
			w.failures.Inc()
			w.upGauge.Set(0)
			w.up.Store(false)
			if downSince.IsZero() {
				downSince, lastWarn = now, now
				w.log.Warn("relay: cannot reach any Kafka broker; events wait in the outbox", "error", err)
			} else if now.Sub(lastWarn) >= w.warnEvery {
				lastWarn = now
				w.log.Warn("relay: still cannot reach any Kafka broker; events wait in the outbox", "down_for", now.Sub(downSince).Round(time.Second), "error", err)
			}
		default:
			w.upGauge.Set(1)
			w.up.Store(true)
			if !downSince.IsZero() {
				w.log.Info("relay: Kafka reachable again", "after", now.Sub(downSince).Round(time.Second))
				downSince = time.Time{}
			}
			if d := w.waiting(); d >= w.warnEvery && now.Sub(lastStuck) >= w.warnEvery {
				lastStuck = now
				w.log.Warn("relay: brokers answer but have not acknowledged a publish in flight, a round or a side retry (check advertised listeners, ACLs, in-sync replicas)", "waiting", d.Round(time.Second))
			}
		}
		w.checked.Store(true)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// probes serves /livez and /readyz (and /healthz, an alias of /readyz
// kept for existing probes). Bodies name no user, host or database.
type probes struct {
	pool    *pgxpool.Pool
	watch   *brokerWatch
	relay   atomic.Pointer[relay.Relay] // nil while waiting for the database
	stallAt time.Duration               // /livez fails when the loop has not passed for this long
	// backends are the pool's sessions: a loop stalled while one of them
	// waits for a table lock of schema is waiting on purpose. Nil: not
	// asked.
	backends *backendPIDs
	schema   string
}

func (p *probes) register(mux *http.ServeMux) {
	mux.HandleFunc("/livez", p.livez)
	mux.HandleFunc("/readyz", p.readyz)
	mux.HandleFunc("/healthz", p.readyz)
}

// livez: the process runs and its publish loop is progressing, or waiting
// on purpose (for the database at start, or for Kafka to acknowledge).
func (p *probes) livez(w http.ResponseWriter, req *http.Request) {
	r := p.relay.Load()
	if r == nil {
		fmt.Fprintln(w, "ok: starting")
		return
	}
	last := r.LastLoop()
	if last.IsZero() || time.Since(last) < p.stallAt || p.watch.waiting() > 0 {
		fmt.Fprintln(w, "ok")
		return
	}
	if p.waitsOnLock(req.Context()) {
		// A long lock on the outbox (VACUUM FULL, CLUSTER, a migration):
		// a restart would wait on it again.
		fmt.Fprintln(w, "ok: waiting on a database lock")
		return
	}
	http.Error(w, fmt.Sprintf("publish loop stalled for %s", time.Since(last).Round(time.Second)), http.StatusServiceUnavailable)
}

// waitsOnLock reports whether one of the relay's sessions waits for a
// table lock of its schema (a VACUUM FULL, CLUSTER or migration of the
// outbox). Row locks are left out: the relay's statements wait on those by
// design, for seconds at most. pg_locks, unlike pg_stat_activity, shows
// every session's locks whatever the viewer's role. It asks on a
// connection of its own: during such a lock the pool's may all be
// waiting. Behind PgBouncer the ids are the pooler's, which match no
// server session: false.
func (p *probes) waitsOnLock(ctx context.Context) bool {
	if p.backends == nil {
		return false
	}
	pids := p.backends.list()
	if len(pids) == 0 {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	cfg := p.pool.Config()
	if cfg.BeforeConnect != nil {
		if err := cfg.BeforeConnect(ctx, cfg.ConnConfig); err != nil {
			return false
		}
	}
	conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		return false
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var waits bool
	err = conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks AS l JOIN pg_class AS c ON c.oid = l.relation
WHERE l.pid = ANY($1::int8[]) AND l.locktype = 'relation' AND NOT l.granted
    AND c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = $2::text))`, pids, p.schema).Scan(&waits)
	return err == nil && waits
}

// readyz: the database answers and accepts writes, and a Kafka broker
// answers. A read-only database (a hot standby, a reader endpoint,
// default_transaction_read_only) answers, but the relay can take no shard
// there: it waits, as after a failover, and is not ready meanwhile.
func (p *probes) readyz(w http.ResponseWriter, req *http.Request) {
	var bad []string
	pingCtx, cancel := context.WithTimeout(req.Context(), 2*time.Second)
	defer cancel()
	// One round trip, as a ping; the simple protocol prepares nothing.
	var readOnly string
	err := p.pool.QueryRow(pingCtx, `SELECT current_setting('transaction_read_only')`, pgx.QueryExecModeSimpleProtocol).Scan(&readOnly)
	switch {
	case err != nil:
		bad = append(bad, "database unreachable")
	case readOnly == "on":
		bad = append(bad, "database read-only")
	}
	if !p.watch.reachable() {
		bad = append(bad, "kafka unreachable")
	}
	if len(bad) == 0 && p.relay.Load() == nil {
		bad = append(bad, "starting")
	}
	if len(bad) > 0 {
		http.Error(w, strings.Join(bad, "; "), http.StatusServiceUnavailable)
		return
	}
	fmt.Fprintln(w, "ok")
}

// databaseBackoff is waitForDatabase's: about 1 s growing to about 30 s,
// each wait ±50% at random, never giving up.
func databaseBackoff() *backoff.ExponentialBackOff {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = time.Second, 30*time.Second, 0
	bo.Reset() // takes InitialInterval: the constructor reset to its own
	return bo
}

// waitForDatabase pings until the database answers, with backoff (about 1 s
// up to about 30 s, ±50% at random), logging each failure at Warn. Errors
// that waiting cannot fix (authentication, a database that does not exist, a
// certificate that does not verify) return at once, as does every error
// when wait is false.
func waitForDatabase(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger, wait bool) error {
	bo := databaseBackoff()
	start := time.Now()
	for {
		pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := pool.Ping(pingCtx)
		cancel()
		switch {
		case err == nil:
			if time.Since(start) > time.Second {
				log.Info("relay: database answers", "after", time.Since(start).Round(time.Second))
			}
			return nil
		case ctx.Err() != nil:
			return ctx.Err()
		case !wait || permanentDBError(err):
			cfg := pool.Config().ConnConfig
			return fmt.Errorf("connect to database %s@%s:%d/%s: %w", cfg.User, cfg.Host, cfg.Port, cfg.Database, err)
		}
		next := bo.NextBackOff()
		log.Warn("relay: database unreachable; waiting for it (--wait-for-database)", "error", oneLine(err), "backoff", next.Round(100*time.Millisecond))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(next):
		}
	}
}

// permanentDBError: waiting will not help.
func permanentDBError(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// 28xxx: invalid authorization; 3D000: no such database; 08P01:
		// protocol violation, which is how PgBouncer fails a SASL login.
		return strings.HasPrefix(pgErr.Code, "28") || pgErr.Code == "3D000" || pgErr.Code == "08P01"
	}
	var unknownCA x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var invalid x509.CertificateInvalidError
	return errors.As(err, &unknownCA) || errors.As(err, &hostname) || errors.As(err, &invalid)
}

// backendPIDs keeps a pool's connections, for /livez to ask whether one
// of them waits for a table lock. Keyed by connection, not process id: two
// connections to two hosts (a multi-host URL) may share an id.
type backendPIDs struct {
	mu    sync.Mutex
	conns map[*pgx.Conn]struct{}
}

// install has cfg's connections register, after any AfterConnect and
// before any BeforeClose already set.
func (b *backendPIDs) install(cfg *pgxpool.Config) {
	after, before := cfg.AfterConnect, cfg.BeforeClose
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		if after != nil {
			if err := after(ctx, c); err != nil {
				return err
			}
		}
		b.mu.Lock()
		defer b.mu.Unlock()
		if b.conns == nil {
			b.conns = map[*pgx.Conn]struct{}{}
		}
		b.conns[c] = struct{}{}
		return nil
	}
	cfg.BeforeClose = func(c *pgx.Conn) {
		b.mu.Lock()
		delete(b.conns, c)
		b.mu.Unlock()
		if before != nil {
			before(c)
		}
	}
}

// list returns the connections' process ids. (A connection's id is set
// when it connects, so it may be read while another goroutine uses it; its
// other state may not.)
func (b *backendPIDs) list() []int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]int64, 0, len(b.conns))
	for c := range b.conns {
		out = append(out, int64(c.PgConn().PID()))
	}
	return out
}
