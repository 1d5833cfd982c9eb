package relay_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

// drainEvents lists the backlogs BenchmarkRelayDrainScale drains
// (ONCEFLOW_BENCH_DRAIN, comma-separated; default 300000).
func drainEvents() []int {
	var out []int
	for _, f := range envList("ONCEFLOW_BENCH_DRAIN", "300000") {
		if n, err := strconv.Atoi(f); err == nil && n > 0 {
			out = append(out, n)
		}
	}
	return out
}

func envList(name, def string) []string {
	v := os.Getenv(name)
	if v == "" {
		v = def
	}
	var out []string
	for _, f := range strings.Split(v, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// drainResult is one contender's drain: its rate and, for relays, the CPU
// seconds their processes and their PostgreSQL backends used.
type drainResult struct {
	rate            float64
	relayCPU, pgCPU float64
	// benchCPU is this process's over the same span: kfake's, and for the
	// loop the loop's own too.
	benchCPU float64
	// held is how long another session held the xmin horizon meanwhile
	// (watchHorizon), in seconds.
	held float64
}

func (d drainResult) cpuPerEvent(n int) float64 { return (d.relayCPU + d.pgCPU) / float64(n) }

// allCPUPerEvent counts kfake (and the loop) too: the machine's CPU per
// event, comparable between the loop and the relays.
func (d drainResult) allCPUPerEvent(n int) float64 {
	return (d.relayCPU + d.pgCPU + d.benchCPU) / float64(n)
}

// BenchmarkRelayDrainScale drains backlogs of 300k (and whatever
// ONCEFLOW_BENCH_DRAIN lists, e.g. 100000,300000,1000000,3000000) of
// 256-byte events over 1,000 keys with three contenders:
//
//   - loop: the plain loop (select 1,000 → produce → delete, in this
//     process);
//   - 1: one relay in a process of its own (this test binary run again,
//     TestDrainRelayProcess), with its own pool and publisher;
//   - 4: four such relay processes, their shards spread 64/64/64/64 as
//     they start (leased to their ids by hand, lapsing a few seconds
//     after: each relay then takes its own; the clock starts at the
//     first take).
//
// Each contender drains a fresh, VACUUM ANALYZEd schema filled by one
// INSERT … SELECT; the contenders take turns, the order rotating every
// round (ONCEFLOW_BENCH_ROUNDS, default 3), and medians are reported with
// every round. A relay's clock runs from the start signal (processes
// started, publishers connected) to the last delete reported. CPU per
// event is the relay processes' own (utime+stime from /proc/<pid>/stat)
// plus their PostgreSQL backends' (found by application_name), over the
// same span. ONCEFLOW_BENCH_DRAIN_CONTENDERS picks contenders (default
// loop,1,4; "4@/path/relay.test" runs four relays of another build of this
// test binary, to compare two versions of the relay within one run);
// ONCEFLOW_DRAIN_CPUPROFILE names a directory where each relay
// process writes a CPU profile (ONCEFLOW_DRAIN_MEMPROFILE: its
// allocations).
//
//	ONCEFLOW_BENCH_DRAIN=300000,1000000 go test -run '^$' -bench RelayDrainScale -benchtime 1x -timeout 60m ./relay/
func BenchmarkRelayDrainScale(b *testing.B) {
	rounds := benchRounds
	if n, err := strconv.Atoi(os.Getenv("ONCEFLOW_BENCH_ROUNDS")); err == nil && n > 0 {
		rounds = n
	}
	contenders := envList("ONCEFLOW_BENCH_DRAIN_CONTENDERS", "loop,1,4")
	for range b.N {
		bu := setupBench(b)
		topic := bu.kafka.Topic(b, 8)
		cl := bu.kafka.Client(b, kgo.ProducerLinger(0))
		var firstRelayRate float64
		for _, n := range drainEvents() {
			res := map[string][]drainResult{}
			var oneRatios, fourRatios, cpuRatios []float64
			for round := range rounds {
				got := map[string]drainResult{}
				for i := range contenders {
					c := contenders[(i+round)%len(contenders)]
					schema := pgtest.Schema(b)
					fillN(b, schema, topic, n)
					held := watchHorizon(b)
					switch c {
					case "loop":
						got[c] = drainLoop(b, cl, schema, n)
					default:
						count, bin, _ := strings.Cut(c, "@")
						relays, err := strconv.Atoi(count)
						if err != nil || relays < 1 {
							b.Fatalf("ONCEFLOW_BENCH_DRAIN_CONTENDERS: %q is neither loop nor a number of relays", c)
						}
						if bin == "" {
							bin = os.Args[0]
						}
						got[c] = drainRelayProcesses(b, bin, bu.kafka.Brokers, schema, topic, n, relays)
						var left int
						if err := pgtest.Pool(b).QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{schema, "outbox"}.Sanitize()).Scan(&left); err != nil {
							b.Fatal(err)
						}
						if left != 0 {
							b.Fatalf("%s relays reported %d events published but %d are still in the outbox", c, n, left)
						}
					}
					longest := held()
					r := got[c]
					r.held = longest
					got[c] = r
					pgtest.DropSchema(b, schema)
					res[c] = append(res[c], got[c])
					fmt.Printf("  [%d events, round %d] %-5s %8.0f events/s", n, round+1, c, got[c].rate)
					if longest >= 1 {
						fmt.Printf("  (another transaction held the xmin horizon for %.0f s)", longest)
					}
					if c != "loop" {
						fmt.Printf("  cpu %.2f µs/event (relays %.2f, postgres %.2f)", 1e6*got[c].cpuPerEvent(n), 1e6*got[c].relayCPU/float64(n), 1e6*got[c].pgCPU/float64(n))
					}
					fmt.Printf("  all cpu %.2f µs/event (postgres %.2f, this process %.2f)", 1e6*got[c].allCPUPerEvent(n), 1e6*got[c].pgCPU/float64(n), 1e6*got[c].benchCPU/float64(n))
					fmt.Println()
				}
				if one, ok := got["1"]; ok {
					if loop, ok := got["loop"]; ok {
						oneRatios = append(oneRatios, one.rate/loop.rate)
					}
					if four, ok := got["4"]; ok {
						fourRatios = append(fourRatios, four.rate/one.rate)
						cpuRatios = append(cpuRatios, four.cpuPerEvent(n)/one.cpuPerEvent(n))
					}
				}
			}
			fmt.Printf("\ndrain %d events of 256 B over 1,000 keys (medians of %d rounds, contenders alternating):\n", n, rounds)
			for _, c := range contenders {
				rs := make([]float64, len(res[c]))
				cpus := make([]float64, len(res[c]))
				alls := make([]float64, len(res[c]))
				for i, r := range res[c] {
					rs[i], cpus[i], alls[i] = r.rate, 1e6*r.cpuPerEvent(n), 1e6*r.allCPUPerEvent(n)
				}
				fmt.Printf("  %-5s %8.0f events/s  (runs: %s)", c, median(rs), rates(rs, 1))
				if c != "loop" {
					fmt.Printf("  cpu %.2f µs/event (runs: %s)", median(cpus), strings.Join(fmtFloats(cpus), " "))
				}
				fmt.Printf("  all cpu %.2f µs/event (runs: %s)", median(alls), strings.Join(fmtFloats(alls), " "))
				fmt.Println()
				// The rounds no other session disturbed (the horizon held
				// under a second): a held horizon makes every read walk the
				// rows deleted meanwhile, which swamps the differences.
				var qr, qc []float64
				for _, r := range res[c] {
					if r.held < 1 {
						qr, qc = append(qr, r.rate), append(qc, 1e6*r.allCPUPerEvent(n))
					}
				}
				if len(qr) > 0 {
					fmt.Printf("        undisturbed (%d of %d rounds): %8.0f events/s, all cpu %.2f µs/event (runs: %s)\n", len(qr), len(res[c]), median(qr), median(qc), strings.Join(fmtFloats(qc), " "))
				}
			}
			if len(oneRatios) > 0 {
				fmt.Printf("  1 relay / loop     %.2fx (per round: %s)\n", median(oneRatios), strings.Join(fmtFloats(oneRatios), " "))
				b.ReportMetric(median(oneRatios), fmt.Sprintf("relay/loop@%d", n))
			}
			if len(fourRatios) > 0 {
				fmt.Printf("  4 relays / 1 relay %.2fx (per round: %s)\n", median(fourRatios), strings.Join(fmtFloats(fourRatios), " "))
				fmt.Printf("  cpu/event 4 / 1    %.2fx (per round: %s)\n", median(cpuRatios), strings.Join(fmtFloats(cpuRatios), " "))
				b.ReportMetric(median(fourRatios), fmt.Sprintf("4relays/1relay@%d", n))
				b.ReportMetric(median(cpuRatios), fmt.Sprintf("cpu4/cpu1@%d", n))
			}
			if ones := res["1"]; len(ones) > 0 {
				rs := make([]float64, len(ones))
				for i, r := range ones {
					rs[i] = r.rate
				}
				if firstRelayRate == 0 {
					firstRelayRate = median(rs)
				} else {
					fmt.Printf("  1 relay here / at the first backlog listed %.2fx\n", median(rs)/firstRelayRate)
				}
			}
		}
	}
}

func fmtFloats(xs []float64) []string {
	out := make([]string, len(xs))
	for i, x := range xs {
		out[i] = strconv.FormatFloat(x, 'f', 2, 64)
	}
	return out
}

// drainChild is what a relay process of BenchmarkRelayDrainScale runs.
type drainChild struct {
	Brokers    []string
	Schema     string
	Topic      string
	InstanceID string
	App        string // application_name of its connections
}

// drainRelayProcesses drains schema's n events with relays relay
// processes, their shards assigned round-robin before they start, and
// returns the rate from the start signal to the last delete, with the CPU
// the processes and their PostgreSQL backends used meanwhile.
func drainRelayProcesses(b *testing.B, bin string, brokers []string, schema, topic string, n, relays int) drainResult {
	ctx := context.Background()
	shardsTable := pgx.Identifier{schema, "relay_shards"}.Sanitize()
	var published atomic.Int64
	done := make(chan struct{})
	var once sync.Once
	type child struct {
		cmd   *exec.Cmd
		stdin io.WriteCloser
		app   string
		ready chan struct{}
		exit  chan error
	}
	var children []*child
	defer func() {
		for _, c := range children {
			_ = c.stdin.Close() // tells the relay to stop
		}
		for _, c := range children {
			select {
			case err := <-c.exit:
				if err != nil {
					b.Errorf("relay process %s: %v", c.app, err)
				}
			case <-time.After(time.Minute):
				_ = c.cmd.Process.Kill()
				b.Errorf("relay process %s did not stop within a minute", c.app)
			}
		}
	}()
	for i := range relays {
		app := fmt.Sprintf("drain-%s-%d", schema, i)
		spec, _ := json.Marshal(drainChild{Brokers: brokers, Schema: schema, Topic: topic, InstanceID: "bench-" + strconv.Itoa(i), App: app})
		cmd := exec.Command(bin, "-test.run=^TestDrainRelayProcess$", "-test.count=1")
		cmd.Env = append(os.Environ(), "ONCEFLOW_DRAIN_CHILD="+string(spec))
		cmd.Stderr = os.Stderr
		stdin, err := cmd.StdinPipe()
		if err != nil {
			b.Fatal(err)
		}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			b.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		c := &child{cmd: cmd, stdin: stdin, app: app, ready: make(chan struct{}), exit: make(chan error, 1)}
		children = append(children, c)
		go func() {
			sc := bufio.NewScanner(stdout)
			for sc.Scan() {
				line := sc.Text()
				switch {
				case line == "ready":
					close(c.ready)
				case strings.HasPrefix(line, "published "):
					k, _ := strconv.ParseInt(strings.TrimPrefix(line, "published "), 10, 64)
					if published.Add(k) >= int64(n) {
						once.Do(func() { close(done) })
					}
				}
			}
			c.exit <- cmd.Wait()
		}()
	}
	for _, c := range children {
		select {
		case <-c.ready:
		case err := <-c.exit:
			b.Fatalf("relay process %s exited before it was ready: %v", c.app, err)
		case <-time.After(time.Minute):
			b.Fatalf("relay process %s not ready within a minute", c.app)
		}
	}
	apps := make([]string, len(children))
	pids := make([]int, len(children))
	for i, c := range children {
		apps[i], pids[i] = c.app, c.cmd.Process.Pid
	}
	if relays > 1 {
		// Pre-balanced: relay i is to hold the shards s with s % relays
		// == i. A relay renews only shards it took itself (their epoch),
		// so rows leased to its id by hand are not its own: it takes them
		// once their lease lapses, its own id's first (takeSQL). The lease
		// outlasts the relays' first ticks, so all of them are live by
		// then and each takes its share: its own shards.
		if _, err := pgtest.Pool(b).Exec(ctx, `UPDATE `+shardsTable+`
SET owner = 'bench-' || (shard % $1), lease_until = now() + interval '3 seconds'`, relays); err != nil {
			b.Fatal(err)
		}
	}
	pg0, proc0, self0 := backendTicks(b, apps), procCPU(pids), statCPU("/proc/self/stat")
	stopPerf := perfBackends(b, apps[0])
	start := time.Now()
	for _, c := range children {
		if _, err := io.WriteString(c.stdin, "go\n"); err != nil {
			b.Fatal(err)
		}
	}
	if relays > 1 {
		// The drain starts at the relays' takes of their shards (within a
		// few ms of one another: their lease ticks started together).
		for taken := 0; taken == 0; {
			if time.Since(start) > time.Minute {
				b.Fatalf("%d relays took no shard within a minute", relays)
			}
			time.Sleep(time.Millisecond)
			if err := pgtest.Pool(b).QueryRow(ctx, `SELECT count(*) FROM `+shardsTable+` WHERE epoch > 0`).Scan(&taken); err != nil {
				b.Fatal(err)
			}
		}
		pg0, proc0, self0 = backendTicks(b, apps), procCPU(pids), statCPU("/proc/self/stat")
		start = time.Now()
	}
	select {
	case <-done:
	case <-time.After(30 * time.Minute):
		b.Fatalf("%d relays did not drain %d events in 30 minutes (%d reported)", relays, n, published.Load())
	}
	elapsed := time.Since(start)
	pg1, proc1, self1 := backendTicks(b, apps), procCPU(pids), statCPU("/proc/self/stat")
	stopPerf(pg1)
	if relays > 1 {
		var spread int
		if err := pgtest.Pool(b).QueryRow(ctx, `SELECT count(*) FROM `+shardsTable+` WHERE owner = 'bench-' || (shard % $1) AND epoch > 0`, relays).Scan(&spread); err != nil {
			b.Fatal(err)
		}
		if spread != relay.NumShards {
			b.Errorf("after the drain %d of %d shards were held by the relay they were spread to, want all: the run measured another shape", spread, relay.NumShards)
		}
	}
	return drainResult{rate: perSecond(n, elapsed), relayCPU: proc1 - proc0, pgCPU: backendDelta(pg0, pg1), benchCPU: self1 - self0}
}

// backendDelta sums the CPU the backends used between two backendTicks.
func backendDelta(before, after map[int32]float64) float64 {
	var pg float64
	for pid, t := range after {
		pg += t - before[pid] // a backend started since counts from zero
	}
	return pg
}

// drainLoop drains schema's n events with the plain loop on a pool of its
// own, so its PostgreSQL backend's CPU is counted like a relay's; the
// loop's own CPU is this process's (with kfake's).
func drainLoop(b *testing.B, cl *kgo.Client, schema string, n int) drainResult {
	app := "drain-loop-" + schema
	pool := benchPool(b, app, 1)
	defer pool.Close()
	if err := pool.Ping(context.Background()); err != nil {
		b.Fatal(err)
	}
	pg0, self0 := backendTicks(b, []string{app}), statCPU("/proc/self/stat")
	stopPerf := perfBackends(b, app)
	rate := plainLoopOn(b, pool, cl, schema, n)
	pg1, self1 := backendTicks(b, []string{app}), statCPU("/proc/self/stat")
	stopPerf(pg1)
	return drainResult{rate: rate, pgCPU: backendDelta(pg0, pg1), benchCPU: self1 - self0}
}

// watchHorizon samples, every 200 ms until the returned function is called,
// how long the oldest transaction of another session holding back the xmin
// horizon has been open (in any database: every snapshot taken meanwhile,
// in this database too, starts at its xid), and returns the longest seen
// in seconds. While one is open, the rows a drain deletes cannot be pruned
// or marked dead in the indexes, so every read in id order fetches them
// again from the heap: a drain turns quadratic for its duration, the plain
// loop's as much as the relay's.
func watchHorizon(b *testing.B) func() float64 {
	ctx, cancel := context.WithCancel(context.Background())
	var longest float64
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(200 * time.Millisecond)
		defer t.Stop()
		for {
			var age float64
			if err := pgtest.Pool(b).QueryRow(ctx, `SELECT coalesce(extract(epoch FROM max(now() - xact_start)), 0)::float8
FROM pg_stat_activity WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
    AND backend_type = 'client backend' AND application_name NOT LIKE 'drain-%'`).Scan(&age); err == nil {
				longest = max(longest, age)
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return func() float64 {
		cancel()
		<-done
		return longest
	}
}

// procCPU returns the CPU seconds (user and system) the processes used so
// far.
func procCPU(pids []int) float64 {
	var s float64
	for _, pid := range pids {
		s += statCPU(fmt.Sprintf("/proc/%d/stat", pid))
	}
	return s
}

// statCPU reads utime+stime, in seconds, from a /proc stat file; 0 if it
// is gone.
func statCPU(path string) float64 {
	stat, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	// Fields after the command (which may hold spaces): utime is the 14th
	// field, stime the 15th.
	f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+2:]))
	u, _ := strconv.ParseFloat(f[11], 64)
	s, _ := strconv.ParseFloat(f[12], 64)
	return (u + s) / 100 // USER_HZ
}

// backendTicks returns the CPU seconds used so far by each PostgreSQL
// backend whose application_name is one of apps (the database runs on
// this machine).
func backendTicks(b *testing.B, apps []string) map[int32]float64 {
	rows, _ := pgtest.Pool(b).Query(context.Background(), `SELECT pid FROM pg_stat_activity WHERE application_name = ANY($1)`, apps)
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		b.Fatal(err)
	}
	out := map[int32]float64{}
	for _, pid := range pids {
		out[pid] = statCPU(fmt.Sprintf("/proc/%d/stat", pid))
	}
	return out
}

// TestDrainRelayProcess is one relay process of BenchmarkRelayDrainScale,
// which runs this test binary again with ONCEFLOW_DRAIN_CHILD set; without
// it, it does nothing. The relay connects its pool and publisher, prints
// "ready", starts on a line from stdin, prints "published N" after each
// round it recorded, and stops when stdin closes.
func TestDrainRelayProcess(t *testing.T) {
	spec := os.Getenv("ONCEFLOW_DRAIN_CHILD")
	if spec == "" {
		return // not a relay process of the benchmark
	}
	var c drainChild
	if err := json.Unmarshal([]byte(spec), &c); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = c.App
	if os.Getenv("ONCEFLOW_DRAIN_TRACE") != "" {
		tr := &stmtTracer{stats: map[string]*stmtStat{}}
		cfg.ConnConfig.Tracer = tr
		defer tr.print(os.Stderr, c.App)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := pool.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	pub, err := kgopublisher.New(c.Brokers, &kgopublisher.Config{Opts: []kgo.Opt{
		kgo.MetadataMinAge(50 * time.Millisecond),
		kgo.RetryBackoffFn(func(int) time.Duration { return 20 * time.Millisecond }),
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	if err := pub.Publish(ctx, []relay.Record{{Topic: c.Topic, Value: []byte("warm-up")}})[0]; err != nil {
		t.Fatal(err)
	}
	out := &lockedWriter{w: bufio.NewWriter(os.Stdout)}
	out.line("ready")
	in := bufio.NewReader(os.Stdin)
	if _, err := in.ReadString('\n'); err != nil {
		return // the benchmark gave up
	}
	r, err := relay.New(pool, pub, &relay.Config{Schema: c.Schema, InstanceID: c.InstanceID, Observer: &lineObserver{out: out},
		Logger: slog.New(slog.DiscardHandler)}) // the figures alone on the terminal
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		_, _ = io.Copy(io.Discard, in) // until stdin closes
		cancel()
	}()
	if dir := os.Getenv("ONCEFLOW_DRAIN_CPUPROFILE"); dir != "" {
		// A CPU profile of each relay process, named after its connections.
		f, err := os.Create(filepath.Join(dir, c.App+".pprof"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			t.Fatal(err)
		}
		defer pprof.StopCPUProfile()
	}
	if dir := os.Getenv("ONCEFLOW_DRAIN_MEMPROFILE"); dir != "" {
		// The allocations of each relay process over its run (go tool
		// pprof -sample_index=alloc_space), named after its connections.
		defer func() {
			f, err := os.Create(filepath.Join(dir, c.App+".allocs.pprof"))
			if err != nil {
				t.Error(err)
				return
			}
			defer f.Close()
			if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
				t.Error(err)
			}
		}()
	}
	if err := r.Run(ctx); err != nil {
		t.Fatal(err)
	}
}

type lockedWriter struct {
	mu sync.Mutex
	w  *bufio.Writer
}

func (l *lockedWriter) line(s string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, _ = l.w.WriteString(s + "\n")
	_ = l.w.Flush()
}

// lineObserver prints each recorded round's deletes.
type lineObserver struct{ out *lockedWriter }

func (o *lineObserver) ObserveBatch(s relay.BatchStats) {
	if s.Published > 0 {
		o.out.line("published " + strconv.Itoa(s.Published))
	}
}

func (o *lineObserver) ObserveShards(int) {}

// perfBackends records, when ONCEFLOW_DRAIN_PERF names a directory, the
// whole machine's samples (perf record -a -g) into <dir>/<name>.data until
// the returned function is called with the contender's backends, whose
// pids it writes to <dir>/<name>.pids (perf report --pid).
func perfBackends(b *testing.B, name string) func(backends map[int32]float64) {
	dir := os.Getenv("ONCEFLOW_DRAIN_PERF")
	if dir == "" {
		return func(map[int32]float64) {}
	}
	cmd := exec.Command("perf", "record", "-q", "-a", "-g", "-o", filepath.Join(dir, name+".data"))
	if err := cmd.Start(); err != nil {
		b.Logf("perf: %v", err)
		return func(map[int32]float64) {}
	}
	return func(backends map[int32]float64) {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
		var pids []string
		for pid := range backends {
			pids = append(pids, strconv.Itoa(int(pid)))
		}
		_ = os.WriteFile(filepath.Join(dir, name+".pids"), []byte(strings.Join(pids, ",")), 0o644)
	}
}

// stmtTracer counts a relay process's statements and their time
// (ONCEFLOW_DRAIN_TRACE=1): each statement by its first words, each batch
// by the statements it holds, timed from send to the last result.
type stmtTracer struct {
	mu    sync.Mutex
	stats map[string]*stmtStat
}

type stmtStat struct {
	n    int
	took time.Duration
}

type traceKey struct{}

type traceStart struct {
	name  string
	start time.Time
}

func stmtName(sql string) string {
	// The claim's reads share their first words: name them by shape.
	switch {
	case strings.Contains(sql, "WITH f AS MATERIALIZED"):
		return "floor read"
	case strings.Contains(sql, "m.held DESC"):
		return "key-hash read"
	case strings.HasPrefix(sql, "SELECT id, event_id"):
		return "read"
	}
	f := strings.Fields(sql)
	if len(f) > 6 {
		f = f[:6]
	}
	return strings.Join(f, " ")
}

func (t *stmtTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, traceKey{}, &traceStart{name: stmtName(d.SQL), start: time.Now()})
}

func (t *stmtTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	t.end(ctx)
}

func (t *stmtTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	return context.WithValue(ctx, traceKey{}, &traceStart{name: batchName(d.Batch), start: time.Now()})
}

// batchName names a batch by its statements' names, in order.
func batchName(b *pgx.Batch) string {
	names := make([]string, 0, b.Len())
	for _, q := range b.QueuedQueries {
		names = append(names, stmtName(q.SQL))
	}
	return "batch[" + strings.Join(names, " | ") + "]"
}

func (t *stmtTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (t *stmtTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchEndData) {
	t.end(ctx)
}

func (t *stmtTracer) end(ctx context.Context) {
	s, ok := ctx.Value(traceKey{}).(*traceStart)
	if !ok {
		return
	}
	took := time.Since(s.start)
	t.mu.Lock()
	defer t.mu.Unlock()
	st := t.stats[s.name]
	if st == nil {
		st = &stmtStat{}
		t.stats[s.name] = st
	}
	st.n++
	st.took += took
}

func (t *stmtTracer) print(w io.Writer, app string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for name, st := range t.stats {
		fmt.Fprintf(w, "trace %s: %6d × %8.3f ms = %8.0f ms  %s\n", app, st.n, float64(st.took.Microseconds())/1e3/float64(st.n), float64(st.took.Milliseconds()), name)
	}
}
