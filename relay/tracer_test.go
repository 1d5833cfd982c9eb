package relay

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// BatchTracer shows See every statement queued in the batches a pool
// sends, as it sends them. Exported for the package's external tests too.
type BatchTracer struct{ See func(q *pgx.QueuedQuery) }

func (b BatchTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	for _, q := range d.Batch.QueuedQueries {
		b.See(q)
	}
	return ctx
}
func (BatchTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (BatchTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}
func (BatchTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (BatchTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
