package relay

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pendingEvent is an outbox row being published.
type pendingEvent struct {
	id        int64
	eventID   []byte // canonical text form, as published in message-id
	topic     string
	key       []byte
	value     []byte
	headers   map[string]string
	createdAt time.Time
	// refusedFor is how long, in seconds on the database clock, the event's
	// topic has been refused without a break (refusedKind says how); nil if
	// the last attempt was not such a refusal.
	refusedFor  *float64
	refusedKind *int16
}

// store holds the relay's SQL for one schema. Every statement is short and
// autocommitted: no transaction stays open while Kafka is being talked to.
type store struct {
	pool *pgxpool.Pool

	claimSQL         [2][2]string // [excluded ids form one run][keys blocked]
	markSQL          string
	deleteSQL        string
	deleteOwnedSQL   string
	deadSQL          string
	failSQL          string
	heartbeatSQL     string
	holderSQL        string
	renewSQL         string
	takeSQL          string
	releaseSQL       string
	releaseAllSQL    string
	goodbyeSQL       string
	landedSQL        string
	forgetRoundsSQL  string
	chargeCrashedSQL string
	chargeOwnSQL     string
	forgetOldSQL     string
	liveInstancesSQL string
}

func newStore(pool *pgxpool.Pool, schema string) *store {
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	dead := pgx.Identifier{schema, "outbox_dead"}.Sanitize()
	shards := pgx.Identifier{schema, "relay_shards"}.Sanitize()
	instances := pgx.Identifier{schema, "relay_instances"}.Sanitize()
	rounds := pgx.Identifier{schema, "relay_rounds"}.Sanitize()
	// owned restricts a statement on outbox row o to shards this relay
	// ($owner) still holds a live lease on: the re-check before delete.
	owned := func(owner string) string {
		return `EXISTS (SELECT 1 FROM ` + shards + ` s WHERE s.shard = o.shard AND s.owner = ` + owner + ` AND s.lease_until > now())`
	}
	return &store{
		pool: pool,
		claimSQL: [2][2]string{
			{claimQuery(outbox, false, false), claimQuery(outbox, false, true)},
			{claimQuery(outbox, true, false), claimQuery(outbox, true, true)},
		},
		// The span of ids (and the shards) of a round about to be
		// published: one small row, not one write per event. If the relay
		// dies before the round lands, a survivor charges the span's events
		// an attempt (chargeCrashedSQL). (Written by the claim statement
		// itself, as a CTE, it made the claim a third slower: the round's
		// rows were materialised to feed min and max.)
		//
		// Two rounds in flight can share a lowest id (a read-ahead may read
		// again the failed first event of the round being recorded): the
		// later round's mark takes the row over, and the earlier round's
		// landedSQL, keyed on both ends, leaves it alone.
		markSQL: `INSERT INTO ` + rounds + ` AS r (instance, lo, hi, shards) VALUES ($1, $2, $3, $4)
ON CONFLICT (instance, lo) DO UPDATE SET hi = excluded.hi, shards = excluded.shards`,
		// The ownership re-check before delete, in the common case: one
		// look at relay_shards that this relay still holds exactly the
		// shards the round was read from ($3, sorted), then the delete by
		// id with no per-row check. If a shard changed hands since, it
		// deletes nothing, and deleteOwnedSQL decides row by row.
		deleteSQL: `DELETE FROM ` + outbox + ` o WHERE o.id = ANY($1::bigint[])
    AND (SELECT array_agg(shard ORDER BY shard) FROM ` + shards + ` WHERE owner = $2 AND lease_until > now()) = $3::smallint[]`,
		// Row by row: a hashed subplan of the shards not (or no longer)
		// held.
		deleteOwnedSQL: `DELETE FROM ` + outbox + ` o WHERE o.id = ANY($1::bigint[])
    AND o.shard NOT IN (SELECT shard FROM ` + shards + ` WHERE (owner = $2 AND lease_until > now()) IS NOT TRUE)`,
		deadSQL: `WITH moved AS (
    DELETE FROM ` + outbox + ` o USING unnest($1::bigint[], $2::text[]) AS x(id, error)
    WHERE o.id = x.id AND ` + owned("$3") + `
    RETURNING o.id, o.event_id, o.topic, o.key, o.value, o.headers, o.created_at, o.attempts, x.error)
INSERT INTO ` + dead + ` (outbox_id, event_id, topic, key, value, headers, created_at, attempts, error)
SELECT id, event_id, topic, key, value, headers, created_at, attempts + 1, error FROM moved`,
		// A run of one refusal (x.run > 0) goes on while the same answer
		// comes back and starts again on another; any other outcome
		// (x.run = 0) ends it; x.run = -1 (not sent: an earlier event of
		// its key failed) leaves it as it is.
		failSQL: `UPDATE ` + outbox + ` o SET last_error = x.error, attempts = o.attempts + 1,
    first_refused_at = CASE WHEN x.run < 0 THEN o.first_refused_at WHEN x.run = 0 THEN NULL
        WHEN o.refused_kind = x.run THEN coalesce(o.first_refused_at, now()) ELSE now() END,
    refused_kind = CASE WHEN x.run < 0 THEN o.refused_kind WHEN x.run = 0 THEN NULL ELSE x.run END
FROM unnest($1::bigint[], $2::text[], $3::smallint[]) AS x(id, error, run)
WHERE o.id = x.id`,
		// The instance row carries the token of the process that holds
		// it: a process with another token gets it only once its lease
		// has lapsed (no row comes back otherwise: the id is in use).
		heartbeatSQL: `INSERT INTO ` + instances + ` AS i (id, hostname, pid, lease_until, token)
VALUES ($1, $2, $3, now() + $4::interval, $5)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), lease_until = excluded.lease_until,
    hostname = excluded.hostname, pid = excluded.pid, token = excluded.token,
    started_at = CASE WHEN i.token IS NOT DISTINCT FROM excluded.token THEN i.started_at ELSE now() END
WHERE i.token IS NOT DISTINCT FROM excluded.token OR i.lease_until <= now()
RETURNING true`,
		holderSQL:        `SELECT hostname, pid, heartbeat_at FROM ` + instances + ` WHERE id = $1`,
		liveInstancesSQL: `SELECT count(*) FROM ` + instances + ` WHERE lease_until > now()`,
		renewSQL: `UPDATE ` + shards + ` SET lease_until = now() + $2::interval
WHERE owner = $1 AND lease_until > now() RETURNING shard`,
		takeSQL: `UPDATE ` + shards + ` SET owner = $1, lease_until = now() + $2::interval
WHERE shard IN (
    SELECT shard FROM ` + shards + `
    WHERE owner IS NULL OR lease_until <= now()
    ORDER BY (owner = $1) DESC NULLS LAST, shard
    LIMIT $3
    FOR UPDATE SKIP LOCKED)
RETURNING shard`,
		releaseSQL:      `UPDATE ` + shards + ` SET owner = NULL, lease_until = NULL WHERE owner = $1 AND shard = ANY($2::smallint[])`,
		releaseAllSQL:   `UPDATE ` + shards + ` SET owner = NULL, lease_until = NULL WHERE owner = $1`,
		goodbyeSQL:      `DELETE FROM ` + instances + ` WHERE id = $1`,
		landedSQL:       `DELETE FROM ` + rounds + ` WHERE instance = $1 AND lo = $2 AND hi = $3`,
		forgetRoundsSQL: `DELETE FROM ` + rounds + ` WHERE instance = $1`,
		chargeOwnSQL: `WITH crashed AS (
    DELETE FROM ` + rounds + ` WHERE instance = $1 RETURNING lo, hi, shards)
UPDATE ` + outbox + ` o SET attempts = o.attempts + 1, last_error = coalesce(o.last_error, 'relay died while publishing')
FROM crashed c WHERE o.id BETWEEN c.lo AND c.hi AND o.shard = ANY(c.shards)`,
		// A round whose relay's lease lapsed (or whose instance row is gone)
		// was cut short.
		chargeCrashedSQL: `WITH crashed AS (
    DELETE FROM ` + rounds + ` r
    WHERE NOT EXISTS (SELECT 1 FROM ` + instances + ` i WHERE i.id = r.instance AND i.lease_until > now())
    RETURNING lo, hi, shards)
UPDATE ` + outbox + ` o SET attempts = o.attempts + 1, last_error = coalesce(o.last_error, 'relay died while publishing')
FROM crashed c WHERE o.id BETWEEN c.lo AND c.hi AND o.shard = ANY(c.shards)`,
		forgetOldSQL: `DELETE FROM ` + instances + ` WHERE lease_until < now() - interval '1 hour'`,
	}
}

// claimQuery returns the statement that reads a round: the oldest pending
// events of the owned shards, in id order, leaving out excluded ids and,
// with blockedKeys, the events of keys waiting out a retry from their failed
// event on.
//
// $1 lists the shards this relay does NOT own, as a NOT IN subquery:
// PostgreSQL runs that as a hashed subplan, one hash probe per row scanned,
// whereas "= ANY($array)" becomes a linear search per row once the prepared
// statement goes to a generic plan (1,000 rows over 128 shards with 1,000
// excluded ids: 6.6 ms against 1.8 ms).
//
// Excluded ids are the rounds in flight (and keyless events waiting out a
// retry). In general they are a NOT IN list ($3), which still visits every
// excluded row in the table. When they form one run of consecutive ids
// ($3 to $4), no other row can lie inside it, so the read is two index
// ranges, below and above the run, merged in id order, and never touches
// the rows in flight: the common case of one relay draining a backlog.
func claimQuery(outbox string, run, blockedKeys bool) string {
	filter := `o.shard NOT IN (SELECT unnest($1::smallint[]))`
	next := 4
	if run {
		next = 5
	}
	if blockedKeys {
		filter += fmt.Sprintf(`
  AND NOT EXISTS (SELECT 1 FROM unnest($%d::bytea[], $%d::bigint[]) AS b(k, first_id)
                  WHERE o.key = b.k AND o.id >= b.first_id)`, next, next+1)
	}
	read := func(where string) string {
		return `SELECT o.id, o.event_id, o.topic, o.key, o.value, o.headers, o.created_at,
       extract(epoch FROM now() - o.first_refused_at)::float8 AS refused_for, o.refused_kind
FROM ` + outbox + ` o
WHERE ` + where + `
ORDER BY o.id
LIMIT $2`
	}
	if !run {
		return read(filter + `
  AND o.id NOT IN (SELECT unnest($3::bigint[]))`)
	}
	return `SELECT * FROM (
(` + read(`o.id < $3 AND `+filter) + `)
UNION ALL
(` + read(`o.id > $4 AND `+filter) + `)
) AS round
ORDER BY id
LIMIT $2`
}

// keyBlock keeps a key's later events back while its failed event waits.
type keyBlock struct {
	key     []byte
	firstID int64
}

// roundKey names a round's relay_rounds row: the lowest and highest id it
// read.
type roundKey struct{ lo, hi int64 }

// keyOf returns the relay_rounds key of a round as claim read it (in id
// order).
func keyOf(events []pendingEvent) roundKey {
	return roundKey{lo: events[0].id, hi: events[len(events)-1].id}
}

// claim reads the oldest pending events of shards, leaving out the events of
// blocked keys and the excluded ids, records their id span as in flight (in
// relay_rounds, before any of them can be published), and returns them in
// id order.
//
// A read-ahead passes the ids of the rounds still in flight as excluded: the
// exact ids, never the range between the lowest and the highest. A row
// inside that range that was not in the round (its transaction committed
// late) must still be read before any later event of its key.
func (s *store) claim(ctx context.Context, owner string, shards []int16, limit int, blockedKeys []keyBlock, excluded []int64) ([]pendingEvent, error) {
	notOwned := make([]int16, 0, NumShards-len(shards))
	for sh := int16(0); sh < NumShards; sh++ {
		if _, found := slices.BinarySearch(shards, sh); !found {
			notOwned = append(notOwned, sh)
		}
	}
	args := []any{notOwned, limit}
	run := 0
	if lo, hi, ok := oneRun(excluded); ok {
		run = 1
		args = append(args, lo, hi)
	} else {
		if excluded == nil {
			excluded = []int64{}
		}
		args = append(args, excluded)
	}
	blocked := 0
	if len(blockedKeys) > 0 {
		blocked = 1
		keys := make([][]byte, len(blockedKeys))
		ids := make([]int64, len(blockedKeys))
		for i, b := range blockedKeys {
			keys[i], ids[i] = b.key, b.firstID
		}
		args = append(args, keys, ids)
	}
	rows, err := s.pool.Query(ctx, s.claimSQL[run][blocked], args...)
	if err != nil {
		return nil, err
	}
	out := make([]pendingEvent, 0, limit)
	for rows.Next() {
		var e pendingEvent
		var headers []byte
		var eventID [16]byte
		if err := rows.Scan(&e.id, &eventID, &e.topic, &e.key, &e.value, &headers, &e.createdAt, &e.refusedFor, &e.refusedKind); err != nil {
			rows.Close()
			return nil, err
		}
		e.eventID = formatUUID(eventID)
		if len(headers) > 0 {
			if err := json.Unmarshal(headers, &e.headers); err != nil {
				// The table's CHECK makes this unreachable for valid
				// rows; publish without headers rather than stall.
				e.headers = map[string]string{"onceflow-bad-headers": string(headers)}
			}
		}
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if len(out) > 0 {
		k := keyOf(out)
		if _, err := s.pool.Exec(ctx, s.markSQL, owner, k.lo, k.hi, shards); err != nil {
			return nil, fmt.Errorf("record the round in flight: %w", err)
		}
	}
	return out, nil
}

// oneRun reports whether ids, in any order, are exactly the consecutive
// integers lo to hi. ids is sorted in place.
func oneRun(ids []int64) (lo, hi int64, ok bool) {
	if len(ids) == 0 {
		return 0, 0, false
	}
	slices.Sort(ids)
	for i := 1; i < len(ids); i++ {
		if ids[i] != ids[i-1]+1 {
			return 0, 0, false
		}
	}
	return ids[0], ids[len(ids)-1], true
}

// formatUUID writes u in the canonical 8-4-4-4-12 form, as PostgreSQL's
// uuid::text does (without asking the server to format every row).
func formatUUID(u [16]byte) []byte {
	b := make([]byte, 36)
	hex.Encode(b[0:8], u[0:4])
	b[8] = '-'
	hex.Encode(b[9:13], u[4:6])
	b[13] = '-'
	hex.Encode(b[14:18], u[6:8])
	b[18] = '-'
	hex.Encode(b[19:23], u[8:10])
	b[23] = '-'
	hex.Encode(b[24:], u[10:])
	return b
}

// finish records one round's outcome in one round trip: deletes the
// acknowledged events and moves the refused ones to outbox_dead (both only
// on shards this relay still owns), and notes the errors of the ones to
// retry. It returns how many acknowledged events it deleted.
// shards are the shards the round was read from, sorted; round is its
// relay_rounds row.
func (s *store) finish(ctx context.Context, owner string, shards []int16, acked []int64, dead []deadEvent, failed []failedEvent, round roundKey) (deleted int64, err error) {
	b := &pgx.Batch{}
	if len(acked) > 0 {
		b.Queue(s.deleteSQL, acked, owner, shards).Exec(func(tag pgconn.CommandTag) error {
			deleted = tag.RowsAffected()
			return nil
		})
	}
	if len(dead) > 0 {
		ids := make([]int64, len(dead))
		errs := make([]string, len(dead))
		for i, d := range dead {
			ids[i], errs[i] = d.id, d.err
		}
		b.Queue(s.deadSQL, ids, errs, owner)
	}
	if len(failed) > 0 {
		ids := make([]int64, len(failed))
		errs := make([]string, len(failed))
		runs := make([]int16, len(failed))
		for i, f := range failed {
			ids[i], errs[i], runs[i] = f.id, f.err, int16(f.run)
		}
		b.Queue(s.failSQL, ids, errs, runs)
	}
	b.Queue(s.landedSQL, owner, round.lo, round.hi)
	if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
		return deleted, fmt.Errorf("record outcome: %w", err)
	}
	if deleted == 0 && len(acked) > 0 {
		// A shard of the round changed hands: delete the events of the
		// shards still held.
		tag, err := s.pool.Exec(ctx, s.deleteOwnedSQL, acked, owner)
		if err != nil {
			return 0, fmt.Errorf("record outcome: %w", err)
		}
		deleted = tag.RowsAffected()
	}
	return deleted, nil
}

type deadEvent struct {
	id  int64
	err string
}

type failedEvent struct {
	id  int64
	err string
	run refusalRun
}

// refusalRun is what a failed attempt does to the event's run of refusals
// (first_refused_at, refused_kind).
type refusalRun int16

const (
	runKeep         refusalRun = -1 // not sent: the run stays as it is
	runReset        refusalRun = 0  // any other answer ends the run
	runUnknownTopic refusalRun = 1
	runForbidden    refusalRun = 2
)
