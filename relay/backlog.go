package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/migrations"
)

// Backlog is what ReadBacklog measured: the given shards' pending events,
// and the database-wide dead letters and shards without an owner.
type Backlog struct {
	// Shards holds one entry per shard asked for, in the order given.
	Shards []ShardFigures
	// DeadLetters counts outbox_dead's rows: exact below DeadExactLimit,
	// otherwise PostgreSQL's estimate of the table's rows (at least
	// DeadExactLimit); DeadLettersExact says which.
	DeadLetters      int64
	DeadLettersExact bool
	// UnownedShards counts shards no live relay holds.
	UnownedShards int
	// ReadAt is the database's clock (now()) at the reading: measure the
	// shards' OldestPending against it, not against this host's clock,
	// which may be skewed from the clock that stamped created_at.
	ReadAt time.Time
}

// ShardFigures is one shard's pending events as ReadBacklog measured them.
type ShardFigures struct {
	Shard int16
	// Pending is exact when Exact is set, an estimate otherwise (see
	// ReadBacklog).
	Pending int64
	Exact   bool
	// OldestPending is the earliest created_at among the shard's first
	// BacklogProbeRows pending events in id order (the head of its queue);
	// zero when the shard holds none.
	OldestPending time.Time
	// MaxAttempts is the highest attempt count among those same events. An
	// event a failure keeps back becomes its shard's first pending event
	// as the shard's other keys drain past it.
	MaxAttempts int
}

const (
	// BacklogProbes is how many evenly spaced points of a shard's id range
	// ReadBacklog reads from.
	BacklogProbes = 4
	// BacklogProbeRows is how many events ReadBacklog reads at each probe:
	// a shard with fewer than that many events between two probe points is
	// counted exactly there.
	BacklogProbeRows = 8
	// DeadExactLimit is how many dead events ReadBacklog counts one by one
	// before it takes PostgreSQL's estimate.
	DeadExactLimit = 10_000
)

// ReadBacklog measures the pending events of shards (each shard at most
// once; nil or empty reads none) at a cost that does not grow with the
// backlog: per shard, two index descents find its lowest and highest
// pending ids, and BacklogProbes descents read up to BacklogProbeRows
// events each from evenly spaced points of that id range, through the
// (shard, id) index. Between two probe points, a shard holding fewer events
// than the probe reads is counted exactly; otherwise the probe's density of
// ids is extrapolated to the rest of the stretch, and the shard's figure is
// marked as an estimate. The estimate is good while a shard's events are
// spread evenly over its id range and coarse after bursts (a stretch is
// judged by its first BacklogProbeRows events). A shard's oldest-pending
// age and highest attempt count come from its first events (see
// ShardFigures).
//
// For the exact, unbounded figures operators ask for on purpose, use
// ReadStatus (a scan of the outbox: seconds at ten million events).
func ReadBacklog(ctx context.Context, db Querier, schema string, shards []int16) (*Backlog, error) {
	if err := migrations.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	id := func(t string) string { return pgx.Identifier{schema, t}.Sanitize() }
	out := &Backlog{Shards: make([]ShardFigures, len(shards))}
	at := make(map[int16]int, len(shards))
	for i, sh := range shards {
		out.Shards[i] = ShardFigures{Shard: sh, Exact: true}
		at[sh] = i
	}
	var estimate int64
	var lo, hi *int64
	if err := db.QueryRow(ctx, `SELECT
    (SELECT count(*) FROM (SELECT 1 FROM `+id("outbox_dead")+` LIMIT `+fmt.Sprint(DeadExactLimit)+`) AS d),
    (SELECT reltuples::bigint FROM pg_class WHERE oid = $1::regclass),
    (SELECT `+unownedShards(id("relay_shards"))+`),
    (SELECT id FROM `+id("outbox")+` ORDER BY id LIMIT 1),
    (SELECT id FROM `+id("outbox")+` ORDER BY id DESC LIMIT 1),
    now()`, id("outbox_dead")).
		Scan(&out.DeadLetters, &estimate, &out.UnownedShards, &lo, &hi, &out.ReadAt); err != nil {
		return nil, fmt.Errorf("relay: read backlog: %w", err)
	}
	out.DeadLettersExact = out.DeadLetters < DeadExactLimit
	if !out.DeadLettersExact {
		out.DeadLetters = max(out.DeadLetters, estimate)
	}
	if lo == nil || hi == nil {
		return out, nil // no event pending
	}
	// The probes: BacklogProbes evenly spaced stretches of the outbox's id
	// range, in each shard, at most backlogChunk shards a statement (a
	// statement over every shard is costed past jit_above_cost, and JIT
	// compilation would take longer than the reads).
	sql := backlogSQL(id("outbox"))
	for len(shards) > 0 {
		chunk := shards[:min(len(shards), backlogChunk)]
		shards = shards[len(chunk):]
		var probeShards []int16
		var js []int32
		var starts, stops []int64
		for _, sh := range chunk {
			for j := range int64(BacklogProbes) {
				probeShards, js = append(probeShards, sh), append(js, int32(j))
				starts = append(starts, *lo+(*hi-*lo+1)*j/BacklogProbes)
				stops = append(stops, *lo+(*hi-*lo+1)*(j+1)/BacklogProbes)
			}
		}
		rows, err := db.Query(ctx, sql, probeShards, js, starts, stops)
		if err != nil {
			return nil, fmt.Errorf("relay: read backlog: %w", err)
		}
		for rows.Next() {
			var p backlogProbe
			if err := rows.Scan(&p.shard, &p.j, &p.start, &p.stop, &p.n, &p.nIn, &p.firstIn, &p.lastIn, &p.oldest, &p.maxAttempts); err != nil {
				rows.Close()
				return nil, fmt.Errorf("relay: read backlog: %w", err)
			}
			if i, ok := at[p.shard]; ok {
				p.add(&out.Shards[i])
			}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, fmt.Errorf("relay: read backlog: %w", err)
		}
	}
	return out, nil
}

// backlogChunk is how many shards one statement of ReadBacklog probes.
const backlogChunk = 64

// backlogProbe is one probe's row of backlogSQL.
type backlogProbe struct {
	shard           int16
	j               int32
	start, stop     int64 // the stretch [start, stop) of the shard's id range
	n, nIn          int64 // events read, and how many of them lie in the stretch
	firstIn, lastIn *int64
	oldest          *time.Time
	maxAttempts     *int
}

// add adds the probe's stretch to its shard's figures.
func (p *backlogProbe) add(f *ShardFigures) {
	if p.j == 0 {
		if p.oldest != nil {
			f.OldestPending = *p.oldest
		}
		if p.maxAttempts != nil {
			f.MaxAttempts = *p.maxAttempts
		}
	}
	if p.n < BacklogProbeRows || p.nIn < p.n || p.nIn < 2 {
		// Every event of the stretch was read.
		f.Pending += p.nIn
		return
	}
	// The stretch holds more than was read: extrapolate the density of the
	// ids read to the rest of it.
	f.Exact = false
	density := float64(p.nIn-1) / float64(*p.lastIn-*p.firstIn)
	f.Pending += p.nIn + int64(density*float64(p.stop-1-*p.lastIn)+0.5)
}

// backlogSQL reads, for each probe ($1 shard, $2 probe number, $3 start
// and $4 end of its stretch of ids), up to BacklogProbeRows events of the
// shard from the stretch's start on: one index range of
// outbox_shard_id_idx. The limit is a literal: a generic plan of "LIMIT $n"
// guesses a tenth of the table.
func backlogSQL(outbox string) string {
	return fmt.Sprintf(`SELECT p.shard, p.j, p.start, p.stop, x.n, x.n_in, x.first_in, x.last_in, x.oldest, x.max_attempts
FROM unnest($1::smallint[], $2::int[], $3::bigint[], $4::bigint[]) AS p(shard, j, start, stop)
CROSS JOIN LATERAL (
    SELECT count(*) AS n, count(*) FILTER (WHERE y.id < p.stop) AS n_in,
        min(y.id) FILTER (WHERE y.id < p.stop) AS first_in, max(y.id) FILTER (WHERE y.id < p.stop) AS last_in,
        min(y.created_at) AS oldest, max(y.attempts) AS max_attempts
    FROM (SELECT o.id, o.created_at, o.attempts FROM %s o
          WHERE o.shard = p.shard AND o.id >= p.start ORDER BY o.id LIMIT %d) AS y) AS x`, outbox, BacklogProbeRows)
}

// unownedShards is the SQL expression of the shards no live relay holds,
// counted as all shards but those held: a shard whose row was deleted by
// hand is held by none (the lease tick writes it back).
func unownedShards(shardsTable string) string {
	return fmt.Sprint(NumShards) + ` - (SELECT count(*) FROM ` + shardsTable + ` WHERE owner IS NOT NULL AND lease_until > now())`
}

// EveryShard returns the shard numbers 0 to NumShards-1, in order.
func EveryShard() []int16 {
	out := make([]int16, NumShards)
	for i := range out {
		out[i] = int16(i)
	}
	return out
}
