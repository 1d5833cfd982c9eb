package relay_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// sqlGate holds back one relay's statements whose SQL contains match (a
// single statement, or a batch holding one) while it is shut: a connection
// that stalls on its way to the server (a failover, a frozen process) while
// the relay's other connections go on.
type sqlGate struct {
	match string
	open  chan struct{} // closed: statements pass
	held  chan struct{} // closed when the first statement was held
	ended chan struct{} // closed once the first held statement has run
	once  sync.Once     // closes held

	mu   sync.Mutex // guards open and shut
	shut bool
}

// sqlGates is a pgx tracer holding back statements at its gates.
type sqlGates struct {
	mu   sync.Mutex
	list []*sqlGate
}

type heldByGateKey struct{}

// add returns a new gate, open until shutNow.
func (g *sqlGates) add(match string) *sqlGate {
	gt := &sqlGate{match: match, open: make(chan struct{}), held: make(chan struct{}), ended: make(chan struct{})}
	close(gt.open)
	g.mu.Lock()
	g.list = append(g.list, gt)
	g.mu.Unlock()
	return gt
}

// shutNow makes statements matching the gate wait until openUp.
func (gt *sqlGate) shutNow() {
	gt.mu.Lock()
	defer gt.mu.Unlock()
	if !gt.shut {
		gt.shut, gt.open = true, make(chan struct{})
	}
}

// openUp lets the held statements (and later ones) pass.
func (gt *sqlGate) openUp() {
	gt.mu.Lock()
	defer gt.mu.Unlock()
	if gt.shut {
		gt.shut = false
		close(gt.open)
	}
}

// wait holds a statement matching one of sqls at a shut gate, and returns
// ctx marked if it is the gate's first held statement.
func (g *sqlGates) wait(ctx context.Context, sqls ...string) context.Context {
	g.mu.Lock()
	list := slices.Clone(g.list)
	g.mu.Unlock()
	for _, gt := range list {
		if !slices.ContainsFunc(sqls, func(sql string) bool { return strings.Contains(sql, gt.match) }) {
			continue
		}
		gt.mu.Lock()
		open, shut := gt.open, gt.shut
		gt.mu.Unlock()
		if !shut {
			continue
		}
		first := false
		gt.once.Do(func() { first = true; close(gt.held) })
		<-open
		if first {
			ctx = context.WithValue(ctx, heldByGateKey{}, gt)
		}
	}
	return ctx
}

func (g *sqlGates) ran(ctx context.Context) {
	if gt, ok := ctx.Value(heldByGateKey{}).(*sqlGate); ok {
		close(gt.ended)
	}
}

func (g *sqlGates) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return g.wait(ctx, d.SQL)
}

func (g *sqlGates) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	g.ran(ctx)
}

func (g *sqlGates) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	if d.Batch == nil {
		return ctx
	}
	sqls := make([]string, len(d.Batch.QueuedQueries))
	for i, q := range d.Batch.QueuedQueries {
		sqls[i] = q.SQL
	}
	return g.wait(ctx, sqls...)
}

func (g *sqlGates) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (g *sqlGates) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchEndData) {
	g.ran(ctx)
}

// wantNoneBothDeadAndPublished fails the test for every event of b's
// outbox_dead (by value) among written, the values published: an event
// both dead-lettered and published (G7; G2's published + dead-lettered =
// written). how says how the test's relay came to do it.
func wantNoneBothDeadAndPublished(t *testing.T, b *bundle, written []string, how string) {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT convert_from(value, 'UTF8') FROM `+pgx.Identifier{b.schema, "outbox_dead"}.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	dead, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range dead {
		if slices.Contains(written, v) {
			t.Errorf("%q was published (written %v) and dead-lettered too (dead %v): %s (G7)", v, written, dead, how)
		}
	}
}

// lockOutboxRow holds the outbox row of value locked (FOR UPDATE) in a
// transaction of its own, an operator's say, until the test rolls it back
// (or ends).
func lockOutboxRow(t *testing.T, b *bundle, value string) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	if _, err := tx.Exec(ctx, `SELECT 1 FROM `+pgx.Identifier{b.schema, "outbox"}.Sanitize()+` WHERE value = $1 FOR UPDATE`, []byte(value)); err != nil {
		t.Fatal(err)
	}
	return tx
}

// lockedDeadLetterSetup writes the stalled-record scenarios' events (F's
// "f", K's "first" and "second"), holds "f"'s row locked in another session
// (an operator's open transaction) and returns that transaction, with a
// publisher that refuses "first" as too large (a dead letter) and fails
// "f" (so the record's failSQL waits on the lock after deadSQL).
func lockedDeadLetterSetup(t *testing.T, b *bundle) (lockTx pgx.Tx, pub *refuseFailPublisher) {
	t.Helper()
	b.write(t,
		outbox.Message{Topic: "t", Key: []byte("F"), Value: []byte("f")},
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("first")},
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("second")},
	)
	lockTx = lockOutboxRow(t, b, "f")
	return lockTx, &refuseFailPublisher{refuse: map[string]bool{"first": true}, fail: map[string]bool{"f": true}}
}

// lockedRecordConfig is the stalled-record scenarios' relay "r0" on b.
func lockedRecordConfig(b *bundle, lease time.Duration) relay.Config {
	return relay.Config{Schema: b.schema, InstanceID: "r0", LeaseDuration: lease, PublishTimeout: 200 * time.Millisecond,
		MaxRetryBackoff: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond}
}

// cutOffWhileItsRecordWaits runs relay "r0" (cfg) until its record waits on
// the locked row after its dead letter, then stalls its lease ticks (it is
// cut off) and waits until its leases lapse.
func cutOffWhileItsRecordWaits(t *testing.T, b *bundle, pub relay.Publisher, cfg relay.Config) {
	t.Helper()
	var g sqlGates
	ticks := g.add(`AS i (id, hostname, pid, lease_until, token`)
	r0 := runGated(t, &g, pub, cfg)
	waitFor(t, "r0's record to wait on the locked row after its dead letter", 30*time.Second, func() bool { return recordsWaitingOnALock(t, b) > 0 })
	ticks.shutNow()
	waitFor(t, "r0's leases to lapse", 30*time.Second, func() bool { return len(r0.OwnedShards()) == 0 && b.lapsed(t, "r0") })
}

// recordsWaitingOnALock counts the sessions whose round record (its
// failSQL, in b's schema) waits on a lock.
func recordsWaitingOnALock(t *testing.T, b *bundle) int {
	t.Helper()
	var n int
	if err := b.pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
    AND query LIKE '%first_refused_at%' AND strpos(query, $1) > 0`, pgx.Identifier{b.schema, "outbox"}.Sanitize()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// runGated runs a relay of cfg on a pool traced by g until the test ends,
// then opens every gate of g and stops it.
func runGated(t *testing.T, g *sqlGates, pub relay.Publisher, cfg relay.Config) *relay.Relay {
	t.Helper()
	r, err := relay.New(pgtest.TracedPool(t, g, 4), pub, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		g.mu.Lock()
		list := slices.Clone(g.list)
		g.mu.Unlock()
		for _, gt := range list {
			gt.openUp()
		}
		cancel()
		<-done
	})
	return r
}
