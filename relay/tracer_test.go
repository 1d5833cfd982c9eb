package relay

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// StatementTracer shows See every statement a pool sends, alone or queued
// in a batch, as it sends it. Exported for the package's external tests
// too.
type StatementTracer struct{ See func(sql string, args []any) }

func (s StatementTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	for _, q := range d.Batch.QueuedQueries {
		s.See(q.SQL, q.Arguments)
	}
	return ctx
}
func (s StatementTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	s.See(d.SQL, d.Args)
	return ctx
}
func (StatementTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (StatementTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}
func (StatementTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData)     {}
