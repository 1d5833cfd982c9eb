package consumer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/consumer"
)

// A pool smaller than the partitions assigned (pgx's default is max(4,
// CPUs)), as when catching up after downtime: a partition with a backlog
// pipelines its commits, each COMMIT carrying its next message's BEGIN on
// the same connection, and used to keep that connection for as long as its
// queue held a message, so another partition's single message waited in
// pool.Acquire for the whole backlog (helper 91: 8.7-9.6 s behind 3,000
// messages; 27 ms with PlainBegin). Partitions now take turns: a worker
// hands its connection back after a bounded run while the pool is
// exhausted.
func TestAPartitionGetsItsTurnOnAPoolSmallerThanThePartitions(t *testing.T) {
	for _, tc := range []struct {
		plain bool
		conc  int
	}{{true, 1}, {false, 1}, {false, 2}} {
		t.Run(fmt.Sprintf("PlainBegin=%v,Concurrency=%d", tc.plain, tc.conc), func(t *testing.T) {
			b := setup(t)
			pool := ownPool(t, func(c *pgxpool.Config) { c.MaxConns = int32(tc.conc) })
			p, err := consumer.New(pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
				return b.record(ctx, tx, "ledger", m)
			}, &consumer.Config{Schema: b.schema, QueueSize: 8192, PlainBegin: tc.plain, Concurrency: tc.conc})
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			trA, trB := &memTransport{}, &memTransport{}
			const n = 3000
			var backlog []consumer.Message
			for i := range n {
				backlog = append(backlog, msg(int64(i), fmt.Sprintf("a-%d", i), fmt.Sprintf("k%d", i%8)))
			}
			wA := p.StartPartition(ctx, trA)
			defer wA.Stop(ctx)
			if err := wA.Add(ctx, backlog...); err != nil {
				t.Fatal(err)
			}
			waitFor(t, 60*time.Second, "A under way", func() bool { return trA.lastMark() >= 10 })
			start := time.Now()
			wB := p.StartPartition(ctx, trB)
			defer wB.Stop(ctx)
			bm := msg(0, "b-0", "")
			bm.Partition = 1
			if err := wB.Add(ctx, bm); err != nil {
				t.Fatal(err)
			}
			waitFor(t, 120*time.Second, "B's message marked", func() bool { return trB.lastMark() == 0 })
			took, aDone := time.Since(start), trA.lastMark()
			t.Logf("B's one message done after %v; A had marked up to offset %d of %d by then", took, aDone, n-1)
			waitFor(t, 120*time.Second, "A's backlog marked", func() bool { return trA.lastMark() == n-1 })
			if aDone >= n/2 {
				t.Errorf("partition B's single message waited %v, until partition A's %d-message backlog was at offset %d: B was starved of the pool's connection", took, n, aDone)
			}
		})
	}
}
