package relay_test

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

	"github.com/onceflow/onceflow/internal/pgtest"
)

// producerSample is where one or more runs of a producer contender spent
// their time.
type producerSample struct {
	tx         int64
	secs       float64
	cpu        float64 // CPU seconds of the writers' backends
	busy       float64 // busy CPU share of the machine (0..1) times secs
	walMissing bool    // a run without WAL figures
	walBytes   int64   // WAL of the transactions that touched the benchmark's tables
	walRecords int64
	walFPI     int64 // of walBytes, full-page images
	waits      map[string]int
	backends   int // in-transaction backends seen, summed over ticks
	ticks      int
}

func (s *producerSample) add(o producerSample) {
	s.tx += o.tx
	s.secs += o.secs
	s.cpu += o.cpu
	s.busy += o.busy
	s.walMissing = s.walMissing || o.walMissing
	s.walBytes += o.walBytes
	s.walRecords += o.walRecords
	s.walFPI += o.walFPI
	if s.waits == nil {
		s.waits = map[string]int{}
	}
	for k, v := range o.waits {
		s.waits[k] += v
	}
	s.backends += o.backends
	s.ticks += o.ticks
}

func (s *producerSample) perTx(x int64) string {
	if s.walMissing || s.tx == 0 {
		return "n/a"
	}
	return strconv.FormatFloat(float64(x)/float64(s.tx), 'f', 0, 64)
}

func (s *producerSample) perTxFrac(x int64) string {
	if s.walMissing || s.tx == 0 {
		return "n/a"
	}
	return strconv.FormatFloat(float64(x)/float64(s.tx), 'f', 1, 64)
}

// waitMix renders the average number of backends inside a transaction and
// the share of each state or wait event among them, largest first.
func (s *producerSample) waitMix() string {
	if s.backends == 0 {
		return "-"
	}
	keys := make([]string, 0, len(s.waits))
	for k := range s.waits {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b string) int { return s.waits[b] - s.waits[a] })
	parts := []string{fmt.Sprintf("%.1f in tx:", float64(s.backends)/float64(s.ticks))}
	for i, k := range keys {
		share := 100 * float64(s.waits[k]) / float64(s.backends)
		if i >= 6 || share < 1 {
			break
		}
		parts = append(parts, fmt.Sprintf("%s %.0f%%", k, share))
	}
	return strings.Join(parts, " ")
}

// producerProfiler measures one contender's run at a time: CPU of the
// writers' backends and of the machine, the WAL their transactions wrote,
// and a sample of pg_stat_activity every 10 ms.
type producerProfiler struct {
	b         *testing.B
	sampler   *pgx.Conn
	walFn     string // pg_get_wal_records_info, schema-qualified; "" without pg_walinspect
	filenodes []uint32

	lsn0   string
	cpu0   map[int32]float64
	stat0  [2]float64
	t0     time.Time
	stopCh chan struct{}
	result chan producerSample
}

// newProducerProfiler installs pg_walinspect in schema unless the database
// has it already (the WAL columns read n/a when it cannot), and notes the
// files of every relation in schemas so their WAL can be told from other
// sessions'.
func newProducerProfiler(b *testing.B, schema string, schemas []string) *producerProfiler {
	ctx := context.Background()
	pool := pgtest.Pool(b)
	p := &producerProfiler{b: b, sampler: pgtest.Conn(b)}
	var ext string
	err := pool.QueryRow(ctx, `SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'pg_walinspect'`).Scan(&ext)
	if err != nil {
		if _, cerr := pool.Exec(ctx, `CREATE EXTENSION pg_walinspect SCHEMA `+pgx.Identifier{schema}.Sanitize()); cerr == nil {
			ext = schema
		} else {
			b.Logf("no WAL figures: pg_walinspect: %v", cerr)
		}
	}
	if ext != "" {
		p.walFn = pgx.Identifier{ext, "pg_get_wal_records_info"}.Sanitize()
	}
	rows, _ := pool.Query(ctx, `SELECT pg_relation_filenode(c.oid)::oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = ANY($1) AND pg_relation_filenode(c.oid) IS NOT NULL`, schemas)
	p.filenodes, err = pgx.CollectRows(rows, pgx.RowTo[uint32])
	if err != nil {
		b.Fatal(err)
	}
	return p
}

func (p *producerProfiler) start() {
	ctx := context.Background()
	if err := pgtest.Pool(p.b).QueryRow(ctx, `SELECT pg_current_wal_flush_lsn()::text`).Scan(&p.lsn0); err != nil {
		p.b.Fatal(err)
	}
	p.cpu0 = backendsOnCPU(p.b, producerApp)
	p.stat0 = machineCPU()
	p.t0 = time.Now()
	p.stopCh, p.result = make(chan struct{}), make(chan producerSample, 1)
	go func() {
		s := producerSample{waits: map[string]int{}}
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-p.stopCh:
				p.result <- s
				return
			case <-tick.C:
			}
			rows, _ := p.sampler.Query(ctx, `SELECT state, coalesce(wait_event_type || ':' || wait_event, '') FROM pg_stat_activity
WHERE application_name = $1 AND state IN ('active', 'idle in transaction')`, producerApp)
			var state, wait string
			_, err := pgx.ForEachRow(rows, []any{&state, &wait}, func() error {
				switch {
				case wait == "Client:ClientRead":
					wait = "client"
				case wait == "" && state == "active":
					wait = "CPU"
				case wait == "":
					wait = state
				}
				s.waits[wait]++
				s.backends++
				return nil
			})
			if err != nil {
				p.b.Error(err)
			}
			s.ticks++
		}
	}()
}

// stop ends the run that committed tx transactions and returns its sample.
func (p *producerProfiler) stop(tx int64) producerSample {
	ctx := context.Background()
	close(p.stopCh)
	s := <-p.result
	s.tx, s.secs = tx, time.Since(p.t0).Seconds()
	stat1 := machineCPU()
	if total := stat1[1] - p.stat0[1]; total > 0 {
		s.busy = (stat1[0] - p.stat0[0]) / total * s.secs
	}
	for pid, t := range backendsOnCPU(p.b, producerApp) {
		s.cpu += t - p.cpu0[pid]
	}
	if p.walFn == "" {
		s.walMissing = true
		return s
	}
	err := pgtest.Pool(p.b).QueryRow(ctx, `WITH r AS (
    SELECT xid::text::bigint AS xid, record_length, fpi_length, block_ref
    FROM `+p.walFn+`($1::pg_lsn, pg_current_wal_flush_lsn())),
ours AS (SELECT DISTINCT xid FROM r WHERE xid <> 0 AND substring(block_ref FROM 'rel \d+/\d+/(\d+)')::oid = ANY($2))
SELECT count(*), coalesce(sum(record_length), 0), coalesce(sum(fpi_length), 0) FROM r WHERE xid IN (SELECT xid FROM ours)`,
		p.lsn0, p.filenodes).Scan(&s.walRecords, &s.walBytes, &s.walFPI)
	if err != nil {
		p.b.Logf("no WAL figures: %v", err)
		s.walMissing = true
	}
	return s
}

// onCPU returns the seconds process pid has run on a CPU so far (the first
// field of /proc/<pid>/schedstat, in nanoseconds), or 0 once it is gone.
func onCPU(pid int32) float64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/schedstat", pid))
	if err != nil {
		return 0
	}
	f := strings.Fields(string(data))
	if len(f) == 0 {
		return 0
	}
	ns, _ := strconv.ParseFloat(f[0], 64)
	return ns / 1e9
}

// backendsOnCPU returns onCPU for each backend whose application_name is app.
func backendsOnCPU(b *testing.B, app string) map[int32]float64 {
	rows, _ := pgtest.Pool(b).Query(context.Background(), `SELECT pid FROM pg_stat_activity WHERE application_name = $1`, app)
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		b.Fatal(err)
	}
	out := make(map[int32]float64, len(pids))
	for _, pid := range pids {
		out[pid] = onCPU(pid)
	}
	return out
}

// machineCPU returns the machine's busy and total CPU ticks so far.
func machineCPU() [2]float64 {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return [2]float64{}
	}
	line, _, _ := strings.Cut(string(data), "\n")
	var busy, total float64
	f := strings.Fields(line)
	if len(f) < 9 {
		return [2]float64{}
	}
	// user nice system idle iowait irq softirq steal (guest time is
	// already counted in user and nice).
	for i, f := range f[1:9] {
		v, _ := strconv.ParseFloat(f, 64)
		total += v
		if i != 3 && i != 4 { // idle, iowait
			busy += v
		}
	}
	return [2]float64{busy, total}
}

// loadAverage returns the 1-minute load average, or "?".
func loadAverage() string {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(data))
	if len(f) == 0 {
		return "?"
	}
	return f[0]
}
