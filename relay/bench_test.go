package relay_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

const (
	benchEvents    = 100_000
	benchValueSize = 256
	benchKeys      = 1000
)

func fillOutbox(b *testing.B, schema, topic string) {
	b.Helper()
	_, err := pgtest.Pool(b).Exec(context.Background(), `INSERT INTO `+pgx.Identifier{schema, "outbox"}.Sanitize()+` (topic, key, value)
SELECT $1, ('key-' || (g % $2))::bytea, convert_to(repeat('x', $3), 'UTF8') FROM generate_series(1, $4) g`,
		topic, benchKeys, benchValueSize, benchEvents)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := pgtest.Pool(b).Exec(context.Background(), `VACUUM ANALYZE `+pgx.Identifier{schema, "outbox"}.Sanitize()); err != nil {
		b.Fatal(err)
	}
}

func perSecond(n int, d time.Duration) float64 { return float64(n) / d.Seconds() }

// BenchmarkRelayDrain drains 100k events of 256 bytes over 1k keys into
// kfake and prints the rate beside the ceilings measured in the same run:
// the database alone (select 1,000 then delete them), the broker alone
// (franz-go produce of 1,000 and wait), and a plain batch loop (select
// 1,000 → produce, wait for acks → delete). The loop and the relay drain
// alternately, drainPairs times each, so both see the same machine; the
// medians and the median of the pairwise ratios are reported.
//
//	go test -run '^$' -bench RelayDrain -benchtime 1x ./relay/
func BenchmarkRelayDrain(b *testing.B) {
	const drainPairs = 5
	ctx := context.Background()
	pool := pgtest.Pool(b)
	for range b.N {
		// Ceiling 1: the database alone.
		dbSchema := pgtest.Schema(b)
		fillOutbox(b, dbSchema, "bench")
		table := pgx.Identifier{dbSchema, "outbox"}.Sanitize()
		start := time.Now()
		for {
			rows, _ := pool.Query(ctx, `SELECT id, event_id, key, value, headers FROM `+table+` ORDER BY id LIMIT 1000`)
			ids, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (int64, error) {
				var id int64
				var ev, k, v, h any
				err := r.Scan(&id, &ev, &k, &v, &h)
				return id, err
			})
			if err != nil {
				b.Fatal(err)
			}
			if len(ids) == 0 {
				break
			}
			if _, err := pool.Exec(ctx, `DELETE FROM `+table+` WHERE id = ANY($1)`, ids); err != nil {
				b.Fatal(err)
			}
		}
		dbRate := perSecond(benchEvents, time.Since(start))

		// Ceiling 2: the broker alone.
		bu := setupBench(b)
		topic := bu.kafka.Topic(b, 8)
		cl := bu.kafka.Client(b, kgo.ProducerLinger(0))
		value := make([]byte, benchValueSize)
		start = time.Now()
		for i := 0; i < benchEvents; i += 1000 {
			recs := make([]*kgo.Record, 1000)
			for j := range recs {
				recs[j] = &kgo.Record{Topic: topic, Key: []byte("key-" + strconv.Itoa((i+j)%benchKeys)), Value: value}
			}
			if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
				b.Fatal(err)
			}
		}
		brokerRate := perSecond(benchEvents, time.Since(start))

		var loopRates, relayRates, ratios []float64
		for range drainPairs {
			loop := drainPlainLoop(b, cl, topic)
			rel := drainRelay(b, bu, topic)
			loopRates, relayRates, ratios = append(loopRates, loop), append(relayRates, rel), append(ratios, rel/loop)
		}
		relayRate, loopRate, ratio := median(relayRates), median(loopRates), median(ratios)
		b.ReportMetric(relayRate, "relay-events/s")
		b.ReportMetric(loopRate, "plain-loop-events/s")
		b.ReportMetric(100*ratio, "relay/loop-%")
		b.ReportMetric(dbRate, "db-ceiling-events/s")
		b.ReportMetric(brokerRate, "broker-ceiling-events/s")
		fmt.Printf("\ndrain %d events of %dB over %d keys (medians of %d alternating runs):\n"+
			"  relay        %8.0f events/s  (runs: %s)\n"+
			"  plain loop   %8.0f events/s  (runs: %s)\n"+
			"  relay/loop   %8.0f %%         (pairwise: %s)\n"+
			"  db ceiling   %8.0f events/s  (select+delete 1,000)\n"+
			"  broker ceil. %8.0f events/s  (franz-go produce 1,000)\n",
			benchEvents, benchValueSize, benchKeys, drainPairs,
			relayRate, rates(relayRates, 1), loopRate, rates(loopRates, 1), 100*ratio, rates(ratios, 100), dbRate, brokerRate)
	}
}

// drainPlainLoop drains a fresh outbox of the benchmark's events with a plain
// batch loop, no ownership, attempt accounting or failure handling, and
// returns its rate.
func drainPlainLoop(b *testing.B, cl *kgo.Client, topic string) float64 {
	schema := pgtest.Schema(b)
	fillOutbox(b, schema, topic)
	return plainLoop(b, cl, schema, benchEvents)
}

// drainRelay drains a fresh outbox of the benchmark's events with a relay in
// its default configuration and returns its rate, from the relay's start
// (publisher connection, schema check, shard leases included) to the last
// delete.
func drainRelay(b *testing.B, bu *bundle, topic string) float64 {
	bu.schema = pgtest.Schema(b)
	fillOutbox(b, bu.schema, topic)
	// The relay reports each round's deletes to its Observer: waiting on
	// that costs the database nothing. (Polling the outbox would not be
	// free: even EXISTS walks every dead row the drain left behind.)
	drained := &drainObserver{want: benchEvents, done: make(chan struct{})}
	// Like the plain loop's client, the relay's publisher is connected
	// before the clock starts (one warm-up record); the relay's own start
	// (schema check, shard leases, listener) is timed.
	pub := bu.publisher(b)
	if err := pub.Publish(context.Background(), []relay.Record{{Topic: topic, Value: []byte("warm-up")}})[0]; err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	_, stop := bu.startRelayWith(b, bu.pool, pub, relay.Config{Observer: drained})
	select {
	case <-drained.done:
	case <-time.After(5 * time.Minute):
		b.Fatal("relay did not drain in 5 minutes")
	}
	rate := perSecond(benchEvents, time.Since(start))
	stop()
	var left int
	if err := pgtest.Pool(b).QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{bu.schema, "outbox"}.Sanitize()).Scan(&left); err != nil {
		b.Fatal(err)
	}
	if left != 0 {
		b.Fatalf("relay reported %d events published but %d are still in the outbox", benchEvents, left)
	}
	return rate
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

func rates(xs []float64, scale float64) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = strconv.FormatFloat(x*scale, 'f', 0, 64)
	}
	return strings.Join(parts, " ")
}

// drainObserver closes done once want events were published and deleted.
type drainObserver struct {
	want      int64
	published atomic.Int64
	done      chan struct{}
	closeOnce sync.Once
}

func (o *drainObserver) ObserveBatch(s relay.BatchStats) {
	// >= and once: rounds that publish nothing (or re-send) still report
	// after the count reached want.
	if o.published.Add(int64(s.Published)) >= o.want {
		o.closeOnce.Do(func() { close(o.done) })
	}
}

func (o *drainObserver) ObserveShards(int) {}

// BenchmarkRelayLatency writes 1,000 events/s (10 per transaction every
// 10 ms) for 10 s and measures commit → consumer latency, which bounds
// commit → Kafka from above.
//
//	go test -run '^$' -bench RelayLatency -benchtime 1x ./relay/
func BenchmarkRelayLatency(b *testing.B) {
	ctx := context.Background()
	for range b.N {
		bu := setupBench(b)
		bu.schema = pgtest.Schema(b)
		w, _ := outbox.NewWriter(&outbox.Config{Schema: bu.schema})
		topic := bu.kafka.Topic(b, 8)
		bu.startRelay(b, relay.Config{PollInterval: time.Second, ProbeInterval: benchProbe})
		cl := bu.kafka.Client(b, kgo.ConsumeTopics(topic), kgo.FetchMaxWait(time.Second))
		const total = 10_000
		committed := make(map[string]time.Time, total)
		received := make(map[string]time.Time, total)
		done := make(chan struct{})
		go func() {
			defer close(done)
			for len(received) < total {
				fs := cl.PollFetches(ctx)
				now := time.Now()
				fs.EachRecord(func(r *kgo.Record) { received[string(r.Value)] = now })
			}
		}()
		tick := time.NewTicker(10 * time.Millisecond)
		var lat []time.Duration
		for i := 0; i < total; i += 10 {
			<-tick.C
			msgs := make([]outbox.Message, 10)
			for j := range msgs {
				msgs[j] = outbox.Message{Topic: topic, Key: []byte(strconv.Itoa((i + j) % benchKeys)), Value: []byte(strconv.Itoa(i + j))}
			}
			if err := pgx.BeginFunc(ctx, pgtest.Pool(b), func(tx pgx.Tx) error { return w.Write(ctx, tx, msgs...) }); err != nil {
				b.Fatal(err)
			}
			now := time.Now()
			for j := range msgs {
				committed[string(msgs[j].Value)] = now
			}
		}
		tick.Stop()
		select {
		case <-done:
		case <-time.After(60 * time.Second):
			b.Fatal("not every event was received")
		}
		for v, c := range committed {
			lat = append(lat, received[v].Sub(c))
		}
		slices.Sort(lat)
		p50, p99, max := lat[len(lat)/2], lat[len(lat)*99/100], lat[len(lat)-1]
		b.ReportMetric(float64(p50.Microseconds())/1000, "p50-ms")
		b.ReportMetric(float64(p99.Microseconds())/1000, "p99-ms")
		fmt.Printf("\ncommit → consumer latency at 1,000 events/s: p50 %s, p99 %s, max %s\n", p50, p99, max)
	}
}

var benchProbe = func() time.Duration {
	d, _ := time.ParseDuration(os.Getenv("BENCH_PROBE"))
	return d
}()
