package relay_test

import (
	"context"
	"slices"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"
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
