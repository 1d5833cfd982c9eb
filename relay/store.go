package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pendingEvent is an outbox row being published.
type pendingEvent struct {
	id        int64
	eventID   string
	topic     string
	key       []byte
	value     []byte
	headers   map[string]string
	shard     int16
	attempts  int
	createdAt time.Time
	// refusedFor is how long, in seconds on the database clock, the event's
	// topic has been unknown; nil if it never was.
	refusedFor *float64
}

// store holds the relay's SQL for one schema. Every statement is short and
// autocommitted: no transaction stays open while Kafka is being talked to.
type store struct {
	pool *pgxpool.Pool

	claimSQL         string
	claimBlockedSQL  string
	deleteSQL        string
	deadSQL          string
	failSQL          string
	heartbeatSQL     string
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
	// The same statement that reads the round records the span of ids in
	// flight (one small row, not one write per event): if the relay dies
	// before the round lands, a survivor charges the span's events an
	// attempt (chargeCrashedSQL).
	//
	// $1 lists the shards this relay does NOT own and $4 the ids to leave
	// out (rounds in flight, keyless events waiting out a retry). Both are
	// NOT IN subqueries because PostgreSQL runs those as hashed subplans,
	// one hash probe per row scanned; "= ANY($array)" becomes a linear
	// search per row once the prepared statement goes to a generic plan
	// (measured: 1,000 rows over 128 shards and 1,000 excluded ids, 6.6 ms
	// against 1.8 ms).
	claim := func(blockedKeys string) string {
		return `WITH round AS (
    SELECT o.id, o.event_id::text, o.topic, o.key, o.value, o.headers, o.shard, o.attempts, o.created_at,
           extract(epoch FROM now() - o.first_refused_at)::float8 AS refused_for
    FROM ` + outbox + ` o
    WHERE o.shard NOT IN (SELECT unnest($1::smallint[]))
      AND o.id NOT IN (SELECT unnest($4::bigint[]))` + blockedKeys + `
    ORDER BY o.id
    LIMIT $2),
mark AS (
    INSERT INTO ` + rounds + ` AS r (instance, lo, hi, shards)
    SELECT $3, min(id), max(id), $5::smallint[] FROM round HAVING count(*) > 0
    ON CONFLICT (instance, lo) DO UPDATE SET hi = greatest(r.hi, excluded.hi), shards = excluded.shards)
SELECT * FROM round`
	}
	return &store{
		pool:     pool,
		claimSQL: claim(""),
		// Keys that are waiting out a retry backoff: no event of theirs at
		// or after the failed one may go first.
		claimBlockedSQL: claim(`
      AND NOT EXISTS (SELECT 1 FROM unnest($6::bytea[], $7::bigint[]) AS b(k, first_id)
                      WHERE o.key = b.k AND o.id >= b.first_id)`),
		// The ownership re-check reads relay_shards once into a hashed
		// subplan (the shards not owned, as in claim), not per row.
		deleteSQL: `DELETE FROM ` + outbox + ` o WHERE o.id = ANY($1::bigint[])
    AND o.shard NOT IN (SELECT shard FROM ` + shards + ` WHERE (owner = $2 AND lease_until > now()) IS NOT TRUE)`,
		deadSQL: `WITH moved AS (
    DELETE FROM ` + outbox + ` o USING unnest($1::bigint[], $2::text[]) AS x(id, error)
    WHERE o.id = x.id AND ` + owned("$3") + `
    RETURNING o.id, o.event_id, o.topic, o.key, o.value, o.headers, o.created_at, o.attempts, x.error)
INSERT INTO ` + dead + ` (outbox_id, event_id, topic, key, value, headers, created_at, attempts, error)
SELECT id, event_id, topic, key, value, headers, created_at, attempts + 1, error FROM moved`,
		failSQL: `UPDATE ` + outbox + ` o SET last_error = x.error, attempts = o.attempts + 1,
    first_refused_at = CASE WHEN x.refused THEN coalesce(o.first_refused_at, now()) ELSE o.first_refused_at END
FROM unnest($1::bigint[], $2::text[], $3::bool[]) AS x(id, error, refused)
WHERE o.id = x.id`,
		heartbeatSQL: `INSERT INTO ` + instances + ` AS i (id, hostname, pid, lease_until)
VALUES ($1, $2, $3, now() + $4::interval)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), lease_until = excluded.lease_until`,
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
		landedSQL:       `DELETE FROM ` + rounds + ` WHERE instance = $1 AND lo = $2`,
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

// keyBlock keeps a key's later events back while its failed event waits.
type keyBlock struct {
	key     []byte
	firstID int64
}

// claim reads the oldest pending events of shards, leaving out the events of
// blocked keys and the excluded ids, records them as in flight, and returns
// them in id order.
//
// A read-ahead passes the ids of the rounds still in flight as excluded: the
// exact ids, never a range. A row inside a round's id range that was not in
// the round (its transaction committed late) must still be read before any
// later event of its key.
func (s *store) claim(ctx context.Context, owner string, shards []int16, limit int, blockedKeys []keyBlock, excluded []int64) ([]pendingEvent, error) {
	notOwned := make([]int16, 0, NumShards-len(shards))
	for sh := int16(0); sh < NumShards; sh++ {
		if _, found := slices.BinarySearch(shards, sh); !found {
			notOwned = append(notOwned, sh)
		}
	}
	if excluded == nil {
		excluded = []int64{}
	}
	var rows pgx.Rows
	var err error
	if len(blockedKeys) == 0 {
		rows, err = s.pool.Query(ctx, s.claimSQL, notOwned, limit, owner, excluded, shards)
	} else {
		keys := make([][]byte, len(blockedKeys))
		ids := make([]int64, len(blockedKeys))
		for i, b := range blockedKeys {
			keys[i], ids[i] = b.key, b.firstID
		}
		rows, err = s.pool.Query(ctx, s.claimBlockedSQL, notOwned, limit, owner, excluded, shards, keys, ids)
	}
	if err != nil {
		return nil, err
	}
	var out []pendingEvent
	for rows.Next() {
		var e pendingEvent
		var headers []byte
		if err := rows.Scan(&e.id, &e.eventID, &e.topic, &e.key, &e.value, &headers, &e.shard, &e.attempts, &e.createdAt, &e.refusedFor); err != nil {
			rows.Close()
			return nil, err
		}
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
	sort.Slice(out, func(i, j int) bool { return out[i].id < out[j].id })
	return out, nil
}

// finish records one round's outcome in one round trip: deletes the
// acknowledged events and moves the refused ones to outbox_dead (both only
// on shards this relay still owns), and notes the errors of the ones to
// retry. It returns how many acknowledged events it deleted.
// roundLo is the lowest id of the round as read: its relay_rounds key.
func (s *store) finish(ctx context.Context, owner string, acked []int64, dead []deadEvent, failed []failedEvent, roundLo int64) (deleted int64, err error) {
	b := &pgx.Batch{}
	if len(acked) > 0 {
		b.Queue(s.deleteSQL, acked, owner).Exec(func(tag pgconn.CommandTag) error {
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
		refused := make([]bool, len(failed))
		for i, f := range failed {
			ids[i], errs[i], refused[i] = f.id, f.err, f.refused
		}
		b.Queue(s.failSQL, ids, errs, refused)
	}
	b.Queue(s.landedSQL, owner, roundLo)
	if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
		return deleted, fmt.Errorf("record outcome: %w", err)
	}
	return deleted, nil
}

type deadEvent struct {
	id  int64
	err string
}

type failedEvent struct {
	id      int64
	err     string
	refused bool // a refusal within its grace period (unknown topic)
}
