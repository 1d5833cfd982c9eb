package consumer_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// BenchmarkProcessorAllocs counts allocations per message on the
// Processor's path (dedup insert, handler, commit, offset marking), one
// partition fed from memory. "untraced" has no HookTrace: tracing must add
// nothing there; compare its allocs/op with the same benchmark before
// HookTrace existed. "traced-nop" adds a HookTrace that does nothing, the
// floor of what tracing costs. The batch- variants are the same in batch
// mode (consumer.NewBatch).
//
//	go test -run '^$' -bench ProcessorAllocs -benchmem ./consumer/
func BenchmarkProcessorAllocs(b *testing.B) {
	for _, tc := range []struct {
		name  string
		batch bool
		hooks []consumer.Hook
	}{
		{"untraced", false, nil},
		{"traced-nop", false, []consumer.Hook{nopTracer{}}},
		{"batch-untraced", true, nil},
		{"batch-traced-nop", true, []consumer.Hook{nopTracer{}}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			schema := pgtest.Schema(b)
			pool := pgtest.Pool(b)
			cfg := &consumer.Config{Schema: schema, Hooks: tc.hooks}
			var p *consumer.Processor
			var err error
			if tc.batch {
				p, err = consumer.NewBatch(pool, "bench", func(context.Context, pgx.Tx, []consumer.Message) error { return nil }, cfg)
			} else {
				p, err = consumer.New(pool, "bench", func(context.Context, pgx.Tx, consumer.Message) error { return nil }, cfg)
			}
			if err != nil {
				b.Fatal(err)
			}
			msgs := make([]consumer.Message, b.N)
			for i := range msgs {
				msgs[i] = msg(int64(i), "m-"+strconv.Itoa(i), "k")
			}
			tr := &memTransport{marks: make([]int64, 0, b.N)}
			ctx := context.Background()
			w := p.StartPartition(ctx, tr)
			defer w.Stop(ctx)
			b.ReportAllocs()
			b.ResetTimer()
			if err := w.Add(ctx, msgs...); err != nil {
				b.Fatal(err)
			}
			for tr.lastMark() != int64(b.N-1) {
				time.Sleep(time.Millisecond)
			}
		})
	}
}

type nopTracer struct{}

func (nopTracer) TraceStart(ctx context.Context, _ consumer.TraceStartEvent) context.Context {
	return ctx
}
func (nopTracer) TraceRetry(context.Context, consumer.RetryEvent)  {}
func (nopTracer) TraceEnd(context.Context, consumer.TraceEndEvent) {}
