package relay_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
)

// timeline records each statement's start and end from t0.
type timeline struct {
	mu    sync.Mutex
	t0    time.Time
	lines []string
}

type tlKey struct{}

type tlStart struct {
	name  string
	start time.Time
}

func (t *timeline) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, tlKey{}, &tlStart{name: stmtName(d.SQL), start: time.Now()})
}

func (t *timeline) TraceQueryEnd(ctx context.Context, c *pgx.Conn, d pgx.TraceQueryEndData) {
	t.end(ctx, c, d.CommandTag.String())
}

func (t *timeline) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	return context.WithValue(ctx, tlKey{}, &tlStart{name: batchName(d.Batch), start: time.Now()})
}

func (t *timeline) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (t *timeline) TraceBatchEnd(ctx context.Context, c *pgx.Conn, _ pgx.TraceBatchEndData) {
	t.end(ctx, c, "")
}

func (t *timeline) end(ctx context.Context, c *pgx.Conn, tag string) {
	s, ok := ctx.Value(tlKey{}).(*tlStart)
	if !ok {
		return
	}
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.lines = append(t.lines, fmt.Sprintf("%8.1f %8.1f %6.1f ms pid %d %s %s", ms(s.start.Sub(t.t0)), ms(now.Sub(t.t0)), ms(now.Sub(s.start)), c.PgConn().PID(), tag, s.name))
}

func (t *timeline) note(s string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.lines = append(t.lines, fmt.Sprintf("%8.1f %s", ms(time.Since(t.t0)), s))
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1e3 }

type tlWriter struct{ t *timeline }

func (w tlWriter) Write(p []byte) (int, error) {
	w.t.note(strings.TrimSpace(string(p)))
	return len(p), nil
}

type tlObserver struct {
	drainObserver
	t       *timeline
	reached [len(tlMilestones)]atomic.Int64 // since t0, ns
}

func (o *tlObserver) ObserveBatch(s relay.BatchStats) {
	o.t.note(fmt.Sprintf("batch published=%d failed=%d took=%s", s.Published, s.Failed, s.Duration))
	before := o.published.Load()
	o.drainObserver.ObserveBatch(s)
	after := before + int64(s.Published)
	for i, at := range tlMilestones {
		if before < at && after >= at {
			o.reached[i].Store(int64(time.Since(o.t.t0)))
		}
	}
}

// tlMilestones are the counts of the other keys' events published at which
// the timeline notes the time: the gap between the two is the drain's
// steady pace, what comes before the first its start.
var tlMilestones = [2]int64{10_000, 45_000}

// BenchmarkStuckKeyTimeline runs BenchmarkRelayStuckKey's drain (300,000
// events of a stuck key, then 50,000 of 1,000 other keys), with and without
// the stuck key, ONCEFLOW_BENCH_TIMELINE times each, alternating, on a pool
// of its own whose statements are traced. It prints, per run, the drain
// time and when the first event of the other keys was acknowledged (the
// first round's cost), then their medians; with ONCEFLOW_TIMELINE_MS it
// prints each run's statements (start, end, duration, backend, tag) and the
// relay's debug log up to that many ms from the relay's start. With
// ONCEFLOW_TIMELINE_ONLY=with or =without it runs that side only. The
// medians split the CPU PostgreSQL spent over each drain between the relay's
// backends and its other processes; ONCEFLOW_TIMELINE_PG=1 prints that per
// run, the others by kind (autovacuum, walwriter, ...).
//
//	ONCEFLOW_BENCH_TIMELINE=3 ONCEFLOW_TIMELINE_MS=150 go test -run '^$' -bench StuckKeyTimeline -benchtime 1x ./relay/
func BenchmarkStuckKeyTimeline(b *testing.B) {
	const stuck, others = 300_000, 50_000
	ctx := context.Background()
	pairs, _ := strconv.Atoi(os.Getenv("ONCEFLOW_BENCH_TIMELINE"))
	if pairs <= 0 {
		b.Skip("ONCEFLOW_BENCH_TIMELINE (runs with and without the stuck key) not set: a profiling aid")
	}
	var upto float64
	if v := os.Getenv("ONCEFLOW_TIMELINE_MS"); v != "" {
		if _, err := fmt.Sscan(v, &upto); err != nil {
			b.Fatalf("ONCEFLOW_TIMELINE_MS: %v", err)
		}
	}
	bu := setupBench(b)
	topic := bu.kafka.Topic(b, 8)
	// ONCEFLOW_TIMELINE_ONLY=with (or without) runs one side only, so that
	// a CPU profile (-cpuprofile, or perf on the backends) holds one.
	sides := []bool{true, false}
	switch v := os.Getenv("ONCEFLOW_TIMELINE_ONLY"); v {
	case "":
	case "with":
		sides = []bool{true}
	case "without":
		sides = []bool{false}
	default:
		b.Fatalf("ONCEFLOW_TIMELINE_ONLY: %q is neither with nor without", v)
	}
	var order []bool
	for range pairs {
		order = append(order, sides...)
	}
	firstAck := map[bool][]float64{}
	at10k := map[bool][]float64{} // ms to the first milestone
	pace := map[bool][]float64{}  // ms per 1,000 events between the milestones
	drain := map[bool][]float64{}
	busy := map[bool][]float64{}    // the machine's busy CPU over each drain, ms
	self := map[bool][]float64{}    // this process's (the relay's and kfake's)
	pgRelay := map[bool][]float64{} // the relay's PostgreSQL backends'
	pgOther := map[bool][]float64{} // every other PostgreSQL process's (the fill's, autovacuum, the WAL writer, ...)
	for _, withStuck := range order {
		fillStuckBench(b, bu, topic, withStuck, stuck, others)
		tl := &timeline{}
		cfg, err := pgxpool.ParseConfig(pgtest.URL(b))
		if err != nil {
			b.Fatal(err)
		}
		cfg.ConnConfig.Tracer = tl
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			b.Fatal(err)
		}
		// Connected before the clock starts, as the shared pool the
		// benchmark's relay uses is.
		var conns []*pgxpool.Conn
		for range 3 {
			c, err := pool.Acquire(ctx)
			if err != nil {
				b.Fatal(err)
			}
			conns = append(conns, c)
		}
		for _, c := range conns {
			c.Release()
		}
		drained := &tlObserver{drainObserver: drainObserver{want: others, done: make(chan struct{})}, t: tl}
		pub := &firstPub{Publisher: &refusingPublisher{Publisher: bu.publisher(b), topic: "stuck"}, t0: &tl.t0}
		logger := slog.New(slog.NewTextHandler(tlWriter{tl}, &slog.HandlerOptions{Level: slog.LevelDebug, ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey || a.Key == "instance" {
				return slog.Attr{}
			}
			return a
		}}))
		cpu0, self0, pg0 := machineCPU(), statCPU("/proc/self/stat"), postgresCPU()
		tl.t0 = time.Now()
		_, stop := bu.startRelayWith(b, pool, pub, relay.Config{Observer: drained, Logger: logger})
		select {
		case <-drained.done:
		case <-time.After(10 * time.Minute):
			b.Fatal("the other keys did not drain in 10 minutes")
		}
		took := time.Since(tl.t0)
		cpu1 := machineCPU()
		busy[withStuck] = append(busy[withStuck], 10*(cpu1[0]-cpu0[0])) // ticks of 10 ms
		self[withStuck] = append(self[withStuck], 1e3*(statCPU("/proc/self/stat")-self0))
		pg1 := postgresCPU()
		relayPids := tl.pids()
		var relayBackends, otherPG float64
		others := map[string]float64{}
		for pid, v := range pg1 {
			d := 1e3 * (v.cpu - pg0[pid].cpu)
			if relayPids[pid] {
				relayBackends += d
			} else {
				otherPG += d
				others[v.what] += d
			}
		}
		pgRelay[withStuck] = append(pgRelay[withStuck], relayBackends)
		pgOther[withStuck] = append(pgOther[withStuck], otherPG)
		if os.Getenv("ONCEFLOW_TIMELINE_PG") != "" {
			fmt.Printf("postgres CPU: relay's backends %.0f ms, others %.0f ms %v\n", relayBackends, otherPG, others)
		}
		stop()
		pool.Close()
		var out bytes.Buffer
		first := ms(time.Duration(pub.first.Load()))
		firstAck[withStuck] = append(firstAck[withStuck], first)
		m0, m1 := ms(time.Duration(drained.reached[0].Load())), ms(time.Duration(drained.reached[1].Load()))
		at10k[withStuck] = append(at10k[withStuck], m0)
		pace[withStuck] = append(pace[withStuck], (m1-m0)/float64(tlMilestones[1]-tlMilestones[0])*1000)
		drain[withStuck] = append(drain[withStuck], ms(took))
		fmt.Fprintf(&out, "== stuck key %-5v  drained in %6.1f ms, first other event acknowledged at %5.1f ms  (load %s)\n", withStuck, ms(took), first, loadavg())
		tl.mu.Lock()
		for _, l := range tl.lines {
			var at float64
			fmt.Sscan(l, &at)
			if at <= upto && upto > 0 {
				out.WriteString(l + "\n")
			}
		}
		tl.mu.Unlock()
		os.Stdout.Write(out.Bytes())
		pgtest.DropSchema(b, bu.schema)
	}
	for _, m := range []map[bool][]float64{firstAck, at10k, pace, drain, busy, self, pgRelay, pgOther} {
		for _, side := range []bool{true, false} {
			if len(m[side]) == 0 {
				m[side] = []float64{0} // a side not run
			}
		}
	}
	fmt.Printf("medians of %d: with the stuck key: drained in %.1f ms, first acknowledged at %.1f ms, machine CPU %.0f ms (this process %.0f, the relay's backends %.0f, other PostgreSQL processes %.0f); without: %.1f ms, %.1f ms, %.0f ms (%.0f, %.0f, %.0f)\n",
		pairs, median(drain[true]), median(firstAck[true]), median(busy[true]), median(self[true]), median(pgRelay[true]), median(pgOther[true]),
		median(drain[false]), median(firstAck[false]), median(busy[false]), median(self[false]), median(pgRelay[false]), median(pgOther[false]))
	fmt.Printf("  the %dth other event published at %.1f ms with the stuck key, %.1f without; from there to the %dth %.2f ms per 1,000 with, %.2f without\n",
		tlMilestones[0], median(at10k[true]), median(at10k[false]), tlMilestones[1], median(pace[true]), median(pace[false]))
}

// firstPub notes when a Publish call first acknowledged a record.
type firstPub struct {
	relay.Publisher
	t0    *time.Time
	first atomic.Int64
}

func (p *firstPub) Publish(ctx context.Context, records []relay.Record) []error {
	errs := p.Publisher.Publish(ctx, records)
	for _, err := range errs {
		if err == nil {
			p.first.CompareAndSwap(0, int64(time.Since(*p.t0)))
			break
		}
	}
	return errs
}

// pids returns the backends the timeline's statements ran on.
func (t *timeline) pids() map[int]bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[int]bool{}
	for _, l := range t.lines {
		if _, after, ok := strings.Cut(l, " pid "); ok {
			var pid int
			if _, err := fmt.Sscan(after, &pid); err == nil {
				out[pid] = true
			}
		}
	}
	return out
}

type processCPU struct {
	what string  // the process's kind from its title ("walwriter"; a backend: its user)
	cpu  float64 // seconds
}

// postgresCPU returns the CPU seconds used so far by each PostgreSQL
// process on this machine, by pid.
func postgresCPU() map[int]processCPU {
	out := map[int]processCPU{}
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil || !bytes.HasPrefix(cmd, []byte("postgres")) {
			continue
		}
		// "postgres: 15/main: walwriter", "postgres: 15/main: autovacuum
		// worker", a backend's "postgres: 15/main: <user> <database> ..."
		f := strings.Fields(strings.ReplaceAll(string(cmd), "\x00", " "))
		what := "postgres"
		if len(f) > 2 {
			what = f[2]
		}
		out[pid] = processCPU{what: what, cpu: statCPU(fmt.Sprintf("/proc/%d/stat", pid))}
	}
	return out
}

func loadavg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}
