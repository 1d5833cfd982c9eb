package relayprom_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relayprom"
)

// BenchmarkScrape times a /metrics scrape of the backlog collector (a
// registry's Gather, every read fresh) on a backlog of N events over 1,000
// keys (100-byte values), for a relay owning every shard and for one of four
// relays owning a quarter, beside the scrape before owned-shard probes
// (relay.ReadShardBacklog and relay.ReadStatus: a count of the outbox per
// shard). Contenders alternate; medians of 7 (of 3 for the scan, slow at
// millions). N comes from ONCEFLOW_BENCH_SCRAPE (comma-separated; default
// 100000); each schema is dropped afterwards.
//
//	ONCEFLOW_BENCH_SCRAPE=1000000,10000000 go test -run '^$' -bench Scrape -benchtime 1x -timeout 60m ./relay/relayprom/
func BenchmarkScrape(b *testing.B) {
	sizes := []int{100_000}
	if env := os.Getenv("ONCEFLOW_BENCH_SCRAPE"); env != "" {
		sizes = nil
		for _, f := range strings.Split(env, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n <= 0 {
				b.Fatalf("ONCEFLOW_BENCH_SCRAPE: %q is not a positive count", f)
			}
			sizes = append(sizes, n)
		}
	}
	ctx := context.Background()
	for range b.N {
		for _, n := range sizes {
			schema := pgtest.Schema(b)
			pool := pgtest.Pool(b)
			outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
			start := time.Now()
			if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value)
SELECT 'bench', ('key-' || (g % 1000))::bytea, convert_to(repeat('x', 100), 'UTF8') FROM generate_series(1, $1) g`, n); err != nil {
				b.Fatal(err)
			}
			if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+outbox); err != nil {
				b.Fatal(err)
			}
			seeded := time.Since(start)
			every := relay.EveryShard()
			scrape := func(owned []int16) func() {
				reg := prometheus.NewRegistry()
				reg.MustRegister(relayprom.NewBacklogCollector(pool, schema, &relayprom.CollectorConfig{
					Owned: func() []int16 { return owned }, MinInterval: time.Nanosecond, Timeout: time.Hour}))
				return func() {
					mfs, err := reg.Gather()
					if err != nil || len(mfs) == 0 {
						b.Fatalf("gather: %v", err)
					}
				}
			}
			before := func() {
				if _, err := relay.ReadShardBacklog(ctx, pool, schema); err != nil {
					b.Fatal(err)
				}
				if _, err := relay.ReadStatus(ctx, pool, schema); err != nil {
					b.Fatal(err)
				}
			}
			contenders := []struct {
				name string
				f    func()
				runs int
			}{
				{"owned probes, every shard", scrape(every), 7},
				{"owned probes, a quarter of the shards", scrape(every[:64]), 7},
				{"before: count per shard + status", before, 3},
			}
			times := make([][]float64, len(contenders))
			for i, c := range contenders {
				c.f() // warm-up
				_ = i
			}
			for round := range 7 {
				for i, c := range contenders {
					if round >= c.runs {
						continue
					}
					t0 := time.Now()
					c.f()
					times[i] = append(times[i], float64(time.Since(t0).Microseconds())/1000)
				}
			}
			fmt.Printf("\nscrape of the backlog collector, %d pending events (seeded in %.0f s), median (ms):\n", n, seeded.Seconds())
			for i, c := range contenders {
				slices.Sort(times[i])
				fmt.Printf("  %-42s %10.1f  (runs: %v)\n", c.name, times[i][len(times[i])/2], times[i])
			}
			pgtest.DropSchema(b, schema)
		}
	}
}
