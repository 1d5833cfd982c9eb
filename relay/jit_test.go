package relay_test

import (
	"context"
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
)

// The relay's statements read and write a round's rows at most, so JIT
// compilation never pays for itself; but PostgreSQL compiles any statement
// whose plan is estimated past jit_above_cost (100,000 by default), and a
// statement that names the outbox gets there on a large table however few
// rows it touches. The lease tick's crash charge did, on every tick from a
// few hundred thousand pending rows: 15-60 ms of a backend's CPU a tick at
// 300,000, 120-250 ms at 1M with four relays (pg_stat_statements), and the
// first tick of a relay that starts beside a stuck key's backlog held its
// first round back as long. Here every statement a relay sends (its ticks,
// the charges of a dead relay's round and of its own from before a
// restart, a stuck key's reads and failures, the other keys' rounds) is
// watched by auto_explain, which says "JIT:" for a statement that was
// compiled. Its sessions run with jit on and jit_above_cost at a tenth of
// its default, for an outbox ten times this one's 350,000 rows (the
// restarted relay's charge passes the default only from a few million).
// Nor may any plan scan the outbox whole: the crash charge, joined to a
// CTE that PostgreSQL estimates at hundreds of thousands of rows, hashed
// the whole table to update one round's events (0.3 s at 350,000 rows; at
// 10M longer than the lease the tick renews after it).
func TestTheRelaysStatementsNeitherJITCompileNorScanALargeOutbox(t *testing.T) {
	if testing.Short() {
		t.Skip("inserts 350,000 rows; skipped with -short")
	}
	b := setup(t)
	ctx := context.Background()
	watch := &planWatch{}
	pool := explainedPool(t, watch)
	flaws := []string{planFlawJIT, planFlawScan}
	if err := pool.Ping(ctx); err != nil { // its sessions' settings, at once
		t.Fatal(err)
	}
	var jitAvailable bool
	if err := b.pool.QueryRow(ctx, `SELECT pg_jit_available()`).Scan(&jitAvailable); err != nil {
		t.Fatal(err)
	}
	if !jitAvailable {
		t.Log("this PostgreSQL cannot JIT-compile (pg_jit_available() is false): only the scans are checked")
		flaws = flaws[1:]
	}

	outboxTable := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	topic := b.kafka.Topic(t, 4)
	const stuck, others = 300_000, 50_000
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+outboxTable+` (topic, key, value)
SELECT 'stuck', 'stuck'::bytea, convert_to(repeat('x', 256), 'UTF8') FROM generate_series(1, $1)`, stuck); err != nil {
		t.Fatal(err)
	}
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+outboxTable+` (topic, key, value)
SELECT $1, ('key-' || (g % 1000))::bytea, convert_to(repeat('x', 256), 'UTF8') FROM generate_series(1, $2) g`, topic, others); err != nil {
		t.Fatal(err)
	}
	if _, err := b.pool.Exec(ctx, `VACUUM ANALYZE `+outboxTable); err != nil {
		t.Fatal(err)
	}
	// What SIGKILLed relays leave: a dead relay's round over the first ten
	// events of the other keys, its instance's lease lapsed, and a round
	// over the next ten of the relay this test restarts under the same id.
	const restarted = "jit-test-relay"
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{b.schema, "relay_instances"}.Sanitize()+
		` (id, lease_until) VALUES ('dead-relay', now() - interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{b.schema, "relay_rounds"}.Sanitize()+` (instance, lo, hi, shards)
SELECT x.instance, min(o.id) + x.skip, min(o.id) + x.skip + 9, (SELECT array_agg(g::smallint) FROM generate_series(0, 255) g)
FROM `+outboxTable+` o, (VALUES ('dead-relay', 0), ($2, 10)) AS x(instance, skip)
WHERE o.topic = $1 GROUP BY x.instance, x.skip`, topic, restarted); err != nil {
		t.Fatal(err)
	}

	_, stop := b.startRelayWith(t, pool, &refusingPublisher{Publisher: b.publisher(t), topic: "stuck"}, relay.Config{InstanceID: restarted})
	waitFor(t, "the other keys' events to be published", 3*time.Minute, func() bool {
		var left int
		if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM `+outboxTable+` WHERE topic = $1`, topic).Scan(&left); err != nil {
			t.Fatal(err)
		}
		return left == 0
	})
	// A few lease ticks more (one every third of the 1 s lease) beside
	// the stuck key's 300,000 events.
	time.Sleep(time.Second)
	stop()

	if n := b.count(t, "relay_rounds"); n != 0 {
		t.Fatalf("%d rounds left in relay_rounds: the crashed rounds were not charged", n)
	}
	if watch.explained() == 0 {
		t.Fatal("auto_explain reported no statement: the test watches nothing")
	}
	for _, flaw := range flaws {
		if texts := watch.texts(flaw); len(texts) > 0 {
			t.Errorf("statements whose plan has %q (of %d explained):\n%s", flaw, watch.explained(), strings.Join(texts, "\n"))
		}
	}
}

// What no plan of the relay's may show: JIT compilation, and a scan of the
// whole outbox.
const (
	planFlawJIT  = "\nJIT:"
	planFlawScan = "Seq Scan on outbox "
)

// watchedJITAboveCost is jit_above_cost in explainedPool's sessions.
const watchedJITAboveCost = 10_000

// planWatch collects auto_explain's notices: how many statements it
// explained, and the texts of those whose plan shows a flaw (planFlawJIT,
// planFlawScan).
type planWatch struct {
	mu     sync.Mutex
	plans  int
	flawed map[string]map[string]int // flaw, statement: times
}

// queryText is what follows "Query Text: " in a notice: the statement, then
// its plan.
var queryText = regexp.MustCompile(`(?s)Query Text: (.*)`)

func (w *planWatch) notice(_ *pgconn.PgConn, n *pgconn.Notice) {
	if !strings.Contains(n.Message, "plan:") {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.plans++
	for _, flaw := range []string{planFlawJIT, planFlawScan} {
		if !strings.Contains(n.Message, flaw) {
			continue
		}
		text := n.Message
		if m := queryText.FindStringSubmatch(n.Message); m != nil {
			text = m[1]
		}
		text = strings.Join(strings.Fields(text), " ")
		if w.flawed == nil {
			w.flawed = map[string]map[string]int{}
		}
		if w.flawed[flaw] == nil {
			w.flawed[flaw] = map[string]int{}
		}
		w.flawed[flaw][text[:min(len(text), 240)]]++
	}
}

func (w *planWatch) explained() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.plans
}

func (w *planWatch) texts(flaw string) []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for text, n := range w.flawed[flaw] {
		out = append(out, fmt.Sprintf("  %d× %s", n, text))
	}
	sort.Strings(out)
	return out
}

// explainedPool is a pool of its own whose every statement auto_explain
// reports to w, as a notice, with its plan, in sessions with jit on and
// jit_above_cost at watchedJITAboveCost. Loading auto_explain in a session
// takes a superuser, as the tests' default URL connects.
func explainedPool(t *testing.T, w *planWatch) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.OnNotice = w.notice
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		for _, sql := range []string{
			`LOAD 'auto_explain'`,
			`SET auto_explain.log_min_duration = 0`,
			`SET auto_explain.log_level = notice`,
			`SET jit = on`,
			`SET jit_above_cost = ` + strconv.Itoa(watchedJITAboveCost),
		} {
			if _, err := c.Exec(ctx, sql); err != nil {
				return fmt.Errorf("%s (loading auto_explain takes a superuser): %w", sql, err)
			}
		}
		return nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}
