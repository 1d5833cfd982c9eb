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
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// producerApp is the application_name of the producer benchmark's writers:
// the profile samples and charges only their backends.
const producerApp = "producer-bench"

// producerVariants are outbox shapes BenchmarkProducerOverhead can measure
// beside the real one, to find what the outbox write costs and what a
// cheaper shape would give up. None is a schema onceflow ships: each is
// the migrated outbox altered by its statements (run with search_path set
// to its own schema). ONCEFLOW_BENCH_PRODUCER_VARIANTS selects them
// (comma-separated names, or "all").
var producerVariants = []producerVariant{
	// The outbox of migration 0004: primary key and (shard, id).
	{"no-key-hash", []string{`DROP INDEX outbox_key_hash_idx`}},
	// Primary key and the key-hash index.
	{"no-shard-id", []string{`DROP INDEX outbox_shard_id_idx`}},
	// The primary key alone: the row and its generated shard column.
	{"pk-only", []string{`DROP INDEX outbox_key_hash_idx`, `DROP INDEX outbox_shard_id_idx`}},
	// Two indexes: the primary key on (shard, id), which a table
	// partitioned by shard range must have anyway, and the key-hash index.
	{"pk-shard-id", []string{
		`DROP INDEX outbox_shard_id_idx`,
		`ALTER TABLE outbox DROP CONSTRAINT outbox_pkey`,
		`ALTER TABLE outbox ADD PRIMARY KEY (shard, id)`,
	}},
	// The same three indexes, the shard and the key hash computed with
	// PostgreSQL's own string hash instead of sha256.
	{"cheap-hash", []string{
		`DROP INDEX outbox_key_hash_idx`,
		`ALTER TABLE outbox DROP COLUMN shard`, // and outbox_shard_id_idx with it
		`ALTER TABLE outbox ADD COLUMN shard smallint NOT NULL GENERATED ALWAYS AS
    (((hashtextextended(encode(coalesce(key, uuid_send(event_id)), 'escape'), 0) >> 56) + 128)::smallint) STORED`,
		`CREATE INDEX outbox_shard_id_idx ON outbox (shard, id)`,
		`CREATE INDEX outbox_key_hash_idx ON outbox ((hashtextextended(encode(coalesce(key, uuid_send(event_id)), 'escape'), 0)), id)`,
	}},
	// The real outbox without its CHECK constraints (topic, headers):
	// PostgreSQL 15 parses and plans a table's CHECK expressions again for
	// every INSERT statement (ExecRelCheck), and so its generated columns'
	// (ExecInitStoredGenerated); a one-row INSERT pays it for one row.
	{"no-checks", []string{`ALTER TABLE outbox DROP CONSTRAINT outbox_topic_check, DROP CONSTRAINT outbox_headers_check`}},
	// The topic check of migrations 8-10, a bounded repetition
	// ('{1,249}'): PostgreSQL's regex engine took 25-40 µs to match a
	// short name against it. Migration 11 states the same rule without it.
	{"topic-check-bounded", []string{
		`ALTER DOMAIN outbox_topic DROP CONSTRAINT outbox_topic_check`,
		`ALTER DOMAIN outbox_topic ADD CONSTRAINT outbox_topic_check
    CHECK (VALUE ~ '^[A-Za-z0-9._-]{1,249}$' AND VALUE NOT IN ('.', '..'))`,
	}},
	// Without the headers check only.
	{"no-headers-check", []string{`ALTER TABLE outbox DROP CONSTRAINT outbox_headers_check`}},
	// The headers check through a PL/pgSQL function (its plan is cached
	// for the session), so the check expression parsed per INSERT is small.
	{"headers-check-fn", []string{
		`CREATE FUNCTION outbox_headers_valid(h jsonb) RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN RETURN jsonb_typeof(h) = 'object' AND NOT jsonb_path_exists(h, '$.* ? (@.type() != "string")'); END $$`,
		`ALTER TABLE outbox DROP CONSTRAINT outbox_headers_check,
    ADD CONSTRAINT outbox_headers_check CHECK (headers IS NULL OR outbox_headers_valid(headers))`,
	}},
	// No stored shard column: the (shard, id) index is on the expression
	// (an index's expressions are kept parsed in the relation cache).
	{"shard-expr", []string{
		`ALTER TABLE outbox DROP COLUMN shard`, // and outbox_shard_id_idx with it
		`CREATE INDEX outbox_shard_id_idx ON outbox ((get_byte(sha256(coalesce(key, uuid_send(event_id))), 0)), id)`,
	}},
	// Both: the three indexes, no generated column, no CHECK constraints.
	{"shard-expr-no-checks", []string{
		`ALTER TABLE outbox DROP CONSTRAINT outbox_topic_check, DROP CONSTRAINT outbox_headers_check`,
		`ALTER TABLE outbox DROP COLUMN shard`,
		`CREATE INDEX outbox_shard_id_idx ON outbox ((get_byte(sha256(coalesce(key, uuid_send(event_id))), 0)), id)`,
	}},
	// The CHECK constraints as migration 0005 wrote them, in full: PostgreSQL
	// 15 reads them back from their stored text and plans them again for
	// every INSERT statement (ExecRelCheck). Migration 0006 made each a cast
	// to a domain, whose CHECK is planned once per connection (the type
	// cache) and only initialised per statement.
	{"checks-0005", []string{`ALTER TABLE outbox DROP CONSTRAINT outbox_topic_check, DROP CONSTRAINT outbox_headers_check,
    ADD CONSTRAINT outbox_topic_check CHECK (topic <> '' AND length(topic) <= 249),
    ADD CONSTRAINT outbox_headers_check CHECK (headers IS NULL OR (jsonb_typeof(headers) = 'object'
        AND NOT jsonb_path_exists(headers, '$.* ? (@.type() != "string")')))`}},
	// The columns typed as the domains themselves, no table CHECK left, so
	// ExecRelCheck is skipped altogether. Not shipped: a driver that types
	// a parameter by what the server describes (pgx) then sees the domain,
	// not jsonb, and binds a []byte or map headers argument as text it
	// cannot parse, so plain-SQL producers would have to write $4::jsonb.
	{"domains", []string{domainColumnsSQL}},
	// Both CHECKs in one table constraint (one expression to parse, not two).
	{"one-check", []string{`ALTER TABLE outbox DROP CONSTRAINT outbox_topic_check, DROP CONSTRAINT outbox_headers_check,
    ADD CONSTRAINT outbox_check CHECK ((topic::outbox_topic) IS NOT NULL AND ((headers::outbox_headers) IS NOT NULL OR headers IS NULL))`}},
	// The generated shard column through one PL/pgSQL function (not
	// inlined, its plan cached per session), so the expression parsed and
	// planned per INSERT is one function call. Dearer: the call costs more
	// than the planning it saves.
	{"shard-fn", []string{shardFnSQL,
		`ALTER TABLE outbox DROP COLUMN shard`,
		`ALTER TABLE outbox ADD COLUMN shard smallint NOT NULL GENERATED ALWAYS AS (outbox_shard(key, event_id)) STORED`,
		`CREATE INDEX outbox_shard_id_idx ON outbox (shard, id)`,
	}},
	// domains, and the key-hash index on a PL/pgSQL function (an index
	// expression is kept parsed in the relation cache, but planned again
	// for every statement that inserts). Dearer, for the same reason.
	{"domains-key-hash-fn", []string{domainColumnsSQL,
		`CREATE FUNCTION outbox_key_hash(key bytea, event_id uuid) RETURNS bytea LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN RETURN substring(sha256(coalesce(key, uuid_send(event_id))) FROM 1 FOR 8); END $$`,
		`DROP INDEX outbox_key_hash_idx`,
		`CREATE INDEX outbox_key_hash_idx ON outbox (outbox_key_hash(key, event_id), id)`,
	}},
	// What partitioning by shard range forces (primary key (shard, id),
	// and the key-hash index), without the CHECK constraints.
	{"pk-shard-id-no-checks", []string{
		`ALTER TABLE outbox DROP CONSTRAINT outbox_topic_check, DROP CONSTRAINT outbox_headers_check`,
		`DROP INDEX outbox_shard_id_idx`,
		`ALTER TABLE outbox DROP CONSTRAINT outbox_pkey`,
		`ALTER TABLE outbox ADD PRIMARY KEY (shard, id)`,
	}},
}

// The statements the variants above share.
const (
	domainColumnsSQL = `ALTER TABLE outbox DROP CONSTRAINT outbox_topic_check, DROP CONSTRAINT outbox_headers_check,
    ALTER COLUMN topic TYPE outbox_topic, ALTER COLUMN headers TYPE outbox_headers`
	shardFnSQL = `CREATE FUNCTION outbox_shard(key bytea, event_id uuid) RETURNS smallint LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN RETURN get_byte(sha256(coalesce(key, uuid_send(event_id))), 0); END $$`
)

// BenchmarkProducerOverhead measures business transactions per second at
// 1, 8, 16 and 32 concurrent writers, each transaction one INSERT into a
// business table plus, depending on the contender, nothing, one row into a
// plain table of the outbox's columns (identity key, uuid default, one
// index, no trigger), one outbox row through the contract's plain SQL, or
// one outbox row with the NOTIFY trigger migration 0004 dropped, and the
// variants ONCEFLOW_BENCH_PRODUCER_VARIANTS selects (see producerVariants).
// Contenders alternate, each for 2 s, benchRounds times; medians are
// reported. ONCEFLOW_BENCH_WRITERS (e.g. "16,32") narrows the writer counts
// ("none": the statement CPU only).
//
// Beside each rate it prints where the time went: the writers' PostgreSQL
// backends' CPU per transaction (/proc), the machine's busy share, the WAL
// each transaction wrote (records whose transaction touched the benchmark's
// tables, read back with pg_walinspect), and what the backends inside a
// transaction were doing (pg_stat_activity sampled every 10 ms: "CPU" is
// active with no wait event, "client" is waiting for the writer's next
// statement).
//
// The outbox's CHECKs run through domains (migration 0006), whose checks
// each connection plans once and keeps until any constraint in the
// database changes: tests creating tables in the same database make the
// outbox dearer while they run. Point ONCEFLOW_TEST_DATABASE_URL at a
// database of its own for steady figures.
//
//	go test -run '^$' -bench ProducerOverhead -benchtime 1x -timeout 30m ./relay/
func BenchmarkProducerOverhead(b *testing.B) {
	ctx := context.Background()
	for range b.N {
		schema := pgtest.Schema(b)
		notify := pgtest.Schema(b) // the outbox as it was before 0004
		pool := benchPool(b, producerApp, 40)
		q := func(s, t string) string { return pgx.Identifier{s, t}.Sanitize() }
		for _, s := range []string{
			`CREATE TABLE ` + q(schema, "business") + ` (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, customer text NOT NULL, amount_cents bigint NOT NULL)`,
			`CREATE TABLE ` + q(schema, "plain") + ` (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, event_id uuid NOT NULL DEFAULT gen_random_uuid(),
    topic text NOT NULL, key bytea, value bytea, headers jsonb, created_at timestamptz NOT NULL DEFAULT now())`,
			`CREATE FUNCTION ` + q(notify, "outbox_notify") + `() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_notify('onceflow_outbox', TG_TABLE_SCHEMA); RETURN NULL; END; $$`,
			`CREATE TRIGGER outbox_notify AFTER INSERT ON ` + q(notify, "outbox") + ` FOR EACH STATEMENT EXECUTE FUNCTION ` + q(notify, "outbox_notify") + `()`,
		} {
			if _, err := pool.Exec(ctx, s); err != nil {
				b.Fatal(err)
			}
		}
		business := `INSERT INTO ` + q(schema, "business") + ` (customer, amount_cents) VALUES ($1, 500)`
		event := func(table string) string {
			return `INSERT INTO ` + table + ` (topic, key, value) VALUES ('orders', $1::bytea, convert_to(repeat('x', 256), 'UTF8'))`
		}
		contenders := []struct {
			name  string
			event string
		}{
			{"business only", ""},
			{"+ plain row", event(q(schema, "plain"))},
			{"+ outbox row", event(q(schema, "outbox"))},
			{"+ outbox, NOTIFY", event(q(notify, "outbox"))},
		}
		schemas := []string{schema, notify}
		for _, v := range selectedVariants(b) {
			s := pgtest.Schema(b)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+pgx.Identifier{s}.Sanitize()); err != nil {
					return err
				}
				for _, stmt := range v.alter {
					if _, err := tx.Exec(ctx, stmt); err != nil {
						return fmt.Errorf("variant %s: %s: %w", v.name, stmt, err)
					}
				}
				return nil
			})
			if err != nil {
				b.Fatal(err)
			}
			contenders = append(contenders, struct{ name, event string }{"+ outbox " + v.name, event(q(s, "outbox"))})
			schemas = append(schemas, s)
		}
		prof := newProducerProfiler(b, schema, schemas)

		run := func(writers int, eventSQL string) (float64, producerSample) {
			var done atomic.Int64
			deadline := time.Now().Add(2 * time.Second)
			var wg sync.WaitGroup
			prof.start()
			start := time.Now()
			for w := range writers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := 0; time.Now().Before(deadline); i++ {
						key := "c" + strconv.Itoa(w) + "-" + strconv.Itoa(i)
						err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
							if _, err := tx.Exec(ctx, business, key); err != nil {
								return err
							}
							if eventSQL != "" {
								_, err := tx.Exec(ctx, eventSQL, key)
								return err
							}
							return nil
						})
						if err != nil {
							b.Error(err)
							return
						}
						done.Add(1)
					}
				}()
			}
			wg.Wait()
			elapsed := time.Since(start)
			return perSecond(int(done.Load()), elapsed), prof.stop(done.Load())
		}

		writerCounts := []int{1, 8, 16, 32}
		if s := os.Getenv("ONCEFLOW_BENCH_WRITERS"); s == "none" {
			writerCounts = nil
		} else if s != "" {
			writerCounts = nil
			for _, f := range strings.Split(s, ",") {
				n, err := strconv.Atoi(strings.TrimSpace(f))
				if err != nil || n < 1 {
					b.Fatalf("ONCEFLOW_BENCH_WRITERS: %q is not a writer count", f)
				}
				writerCounts = append(writerCounts, n)
			}
		}
		// Open every connection now, so no run pays for (or is charged
		// the CPU of) a backend's start.
		conns := make([]*pgxpool.Conn, slices.Max(append(writerCounts, 1)))
		for i := range conns {
			c, err := pool.Acquire(ctx)
			if err != nil {
				b.Fatal(err)
			}
			conns[i] = c
		}
		for _, c := range conns {
			c.Release()
		}
		// The statements' own CPU, without commits or concurrency: one
		// connection runs them in one transaction, rolled back.
		// Other processes on the machine only ever add to a run's CPU time
		// (cache misses, migrations), so the least of the rounds is kept.
		fmt.Printf("\nbackend CPU of the statements alone (one connection, %d transactions' statements in one transaction, no commit;\n"+
			"least of %d alternating rounds, the backend's on-CPU time from /proc/<pid>/schedstat):\n", statementRuns, benchRounds)
		fmt.Printf("  %-31s %9s %13s\n", "contender", "µs/tx", "event µs/tx")
		cpus := make([]float64, len(contenders))
		for round := range benchRounds {
			for i := range contenders {
				c := (i + round) % len(contenders)
				if us := statementCPU(b, pool, business, contenders[c].event); round == 0 || us < cpus[c] {
					cpus[c] = us
				}
			}
		}
		for c := range contenders {
			fmt.Printf("  %-31s %9.1f %13.1f\n", contenders[c].name, cpus[c], cpus[c]-cpus[0])
		}

		if len(writerCounts) == 0 {
			continue
		}
		fmt.Printf("\nbusiness transactions/s (medians of %d alternating 2 s runs); per contender the writers' backends' CPU\n"+
			"per transaction, the machine's busy share, WAL per transaction (bytes, records, full-page-image bytes) and\n"+
			"what the backends inside a transaction were doing (pg_stat_activity every 10 ms):\n", benchRounds)
		summary := make([][]float64, len(writerCounts)) // per writer count: median rate, then median ratio to plain, per contender
		for wi, writers := range writerCounts {
			rates := make([][]float64, len(contenders))
			ratios := make([][]float64, len(contenders))
			samples := make([]producerSample, len(contenders))
			load0 := loadAverage()
			for round := range benchRounds {
				got := make([]float64, len(contenders))
				for i := range contenders {
					c := (i + round) % len(contenders) // rotate who goes first
					var s producerSample
					got[c], s = run(writers, contenders[c].event)
					rates[c] = append(rates[c], got[c])
					samples[c].add(s)
				}
				for c := range contenders {
					ratios[c] = append(ratios[c], got[c]/got[1])
				}
			}
			fmt.Printf("\n  %d writers (load average %s → %s)\n", writers, load0, loadAverage())
			fmt.Printf("  %-31s %8s %7s %9s %5s %8s %6s %8s  %s\n", "contender", "tx/s", "/plain", "cpu µs/tx", "busy", "WAL B/tx", "rec/tx", "FPI B/tx", "in-transaction backends")
			for c := range contenders {
				s := samples[c]
				fmt.Printf("  %-31s %8.0f %6.2fx %9.0f %4.0f%% %8s %6s %8s  %s\n", contenders[c].name, median(rates[c]), median(ratios[c]),
					1e6*s.cpu/float64(s.tx), 100*s.busy/s.secs, s.perTx(s.walBytes), s.perTxFrac(s.walRecords), s.perTx(s.walFPI), s.waitMix())
				summary[wi] = append(summary[wi], median(rates[c]), median(ratios[c]))
			}
			b.ReportMetric(median(ratios[2]), fmt.Sprintf("outbox/plain@%d", writers))
		}
		fmt.Printf("\n  summary, ratio to the plain table (median of per-round ratios):\n  %-31s", "contender")
		for _, w := range writerCounts {
			fmt.Printf(" %8s", fmt.Sprintf("@%d", w))
		}
		fmt.Println()
		for c := range contenders {
			fmt.Printf("  %-31s", contenders[c].name)
			for wi := range writerCounts {
				fmt.Printf(" %7.2fx", summary[wi][2*c+1])
			}
			fmt.Println()
		}
	}
}

type producerVariant struct {
	name  string
	alter []string
}

func selectedVariants(b *testing.B) []producerVariant {
	sel := os.Getenv("ONCEFLOW_BENCH_PRODUCER_VARIANTS")
	if sel == "" {
		return nil
	}
	if sel == "all" {
		return producerVariants
	}
	var out []producerVariant
	for _, name := range strings.Split(sel, ",") {
		i := slices.IndexFunc(producerVariants, func(v producerVariant) bool { return v.name == strings.TrimSpace(name) })
		if i < 0 {
			b.Fatalf("ONCEFLOW_BENCH_PRODUCER_VARIANTS: no variant %q", name)
		}
		out = append(out, producerVariants[i])
	}
	return out
}

// statementRuns is how many transactions' statements statementCPU runs.
const statementRuns = 5000

// statementCPU runs statementRuns transactions' statements (business, then
// event unless it is empty) on one connection inside one transaction,
// rolled back, and returns the CPU its backend used per transaction, in µs.
func statementCPU(b *testing.B, pool *pgxpool.Pool, business, event string) float64 {
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Release()
	var pid int32
	if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		b.Fatal(err)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var cpu0 float64
	for i := -1; i < statementRuns; i++ {
		if i == 0 { // the first is warm-up (plans, caches)
			cpu0 = onCPU(pid)
		}
		key := "s-" + strconv.Itoa(i)
		if _, err := tx.Exec(ctx, business, key); err != nil {
			b.Fatal(err)
		}
		if event != "" {
			if _, err := tx.Exec(ctx, event, key); err != nil {
				b.Fatal(err)
			}
		}
	}
	return 1e6 * (onCPU(pid) - cpu0) / statementRuns
}
