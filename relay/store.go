package relay

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pendingEvent is an outbox row being published.
type pendingEvent struct {
	id        int64
	eventID   []byte // canonical text form, as published in message-id; never modified (eventIDString)
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
	size        int64 // key, value and headers, as counted against Config.BatchBytes
	// withheld: a guarded claim (guardBytes) left its key, value and
	// headers out, the event being larger than a round's share of the bound.
	withheld bool
	// shard: the row's shard, read by a held read only (claimAllQuery,
	// carried through guardBytes); -1 where the read has no such column, so
	// that a held read that lost it hashes every key (fails closed).
	shard int16
	// swept: read by key hash, in a shard holding blocked keys
	// (claimBlockedQuery): where the shard's sweep goes on from.
	swept bool
}

// store holds the relay's SQL for one schema. Every statement is short and
// autocommitted: no transaction stays open while Kafka is being talked to.
type store struct {
	pool   *pgxpool.Pool
	outbox string
	// maxBytes bounds a round's keys, values and headers (an event larger
	// than that goes alone); 0 means no bound.
	maxBytes int64

	claimAllSQL    [2][2]string // every shard owned, none blocked: [excluded ids form one run][under a floor proof]
	claimHeldSQL   [2]string    // claimAllSQL[run][1] with each row's shard: a held read (claimStatements)
	claimAllLimit  int          // claimAllSQL's limit
	claimShards    []int16      // the shards claimShardsSQL reads (sorted)
	claimShardsSQL string       // the other shards, one index range each
	claimInner     int          // claimShardsSQL's limits
	claimLimit     int
	claimFreeSQL   string // many free shards (claimFreeQuery), for claimFreeLimit
	claimFreeLimit int
	claimFloorSQL  string           // nearly every shard free (claimFloorQuery), for claimFreeLimit
	floorFrom      []int64          // see floorBase
	floorKind      readShape        // the shape of the reads floorFrom holds the ids of (floorShape)
	proofShards    []int16          // the shards a floor proof's confirm descends; nil: every shard (queueFloorProof)
	proof          floorProof       // see floorProof
	proving        *proving         // a floor proof under way
	proofWait      int              // floor reads before another proof may start
	runStarted     bool             // the current run of floor-shaped reads started a proof (endRun)
	runUsed        bool             // ... and read with one
	wastedRuns     [numShapes]int   // per shape: runs in a row that ended with a proof started and never read with (endRun)
	lastWasted     [numShapes]int64 // per shape: claimN when the last such run ended
	claimN         int64            // claims so far (claimStatements)
	seqChecked     bool             // proofSequence ran
	seqName        string           // the outbox's id sequence (quoted), "" if none
	dbOID          uint32           // the database's oid (pg_locks.database)
	floorOff       int              // claims left before claimFloorQuery is tried again
	heldOff        int              // claims left before a held read (claimStatements) is tried again
	exactOff       int              // claims left before claimAllQuery is guarded again (guardBytes)
	freeK          map[int16]int    // see freeKs
	// sweep is, per shard holding blocked keys, the key hash its next read
	// starts from (nil: the shard's start); see claimBlockedQuery.
	sweep     map[int16][]byte
	sweepLast map[int16][]byte // scratch for advanceSweeps
	lastFull  bool             // the last claim returned a whole round
	sweptFull bool             // the last claim's key-hash read, beside a floor read, stopped at its limit (mergeBlocked)
	// token is this process's, in its instance row (leases.token): the
	// statements that act for the instance id on another relay's behalf
	// check it, since a stalled earlier process under the same id (a
	// restart under a fixed id) must not act for its successor.
	token string
	// recordLockWait bounds, in milliseconds (five leases: 30 s by
	// default, as the record's own timeout), how long a round's record
	// waits for a lock: see finish.
	recordLockWait   string
	markSQL          string
	deleteSQL        string
	deleteRunSQL     string
	deleteOwnedSQL   string
	deadSQL          string
	failSQL          string
	heartbeatSQL     string
	holderSQL        string
	renewSQL         string
	takeSQL          string
	releaseSQL       string
	ownInstanceSQL   string
	releaseAllSQL    string
	instanceBackSQL  string
	releaseLeasesSQL string
	goodbyeSQL       string
	landedSQL        string
	forgetRoundsSQL  string
	chargeCrashedSQL string
	chargeOwnSQL     string
	forgetOldSQL     string
	liveInstancesSQL string
	restoreShardsSQL string
	probeSQL         string // set by Relay.checkSchema
}

func newStore(pool *pgxpool.Pool, schema string) *store {
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	dead := pgx.Identifier{schema, "outbox_dead"}.Sanitize()
	shards := pgx.Identifier{schema, "relay_shards"}.Sanitize()
	instances := pgx.Identifier{schema, "relay_instances"}.Sanitize()
	rounds := pgx.Identifier{schema, "relay_rounds"}.Sanitize()
	return &store{
		pool:      pool,
		outbox:    outbox,
		sweep:     map[int16][]byte{},
		freeK:     map[int16]int{},
		sweepLast: map[int16][]byte{},
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
		// deleteSQL for acknowledged ids that are one run of consecutive
		// ids, $1 to $2 (a drained backlog's rounds): one range of the
		// primary key, where "= ANY" descends the index once per id
		// (PostgreSQL 15): about 0.5 µs of backend CPU per event less.
		// Every id of the run was acknowledged, so no other row goes. (A
		// join with unnest(los, his) for several runs was estimated at a
		// ninth of the table per run: JIT-compiled at 1M rows.)
		deleteRunSQL: `DELETE FROM ` + outbox + ` o WHERE o.id BETWEEN $1 AND $2
    AND (SELECT array_agg(shard ORDER BY shard) FROM ` + shards + ` WHERE owner = $3 AND lease_until > now()) = $4::smallint[]`,
		// Row by row: a hashed subplan of the shards not (or no longer)
		// held. It also counts the ids it leaves on those shards, for
		// their new owner; the others not deleted were gone already
		// (deleted by hand, or by a relay that took their shard).
		deleteOwnedSQL: `WITH lost AS (
    SELECT shard FROM ` + shards + ` WHERE (owner = $2 AND lease_until > now()) IS NOT TRUE),
deleted AS (
    DELETE FROM ` + outbox + ` o WHERE o.id = ANY($1::bigint[]) AND o.shard NOT IN (SELECT shard FROM lost)
    RETURNING 1)
SELECT (SELECT count(*) FROM deleted),
    (SELECT count(*) FROM ` + outbox + ` o WHERE o.id = ANY($1::bigint[]) AND o.shard IN (SELECT shard FROM lost))`,
		// Dead letters take their ids in outbox id order (the DELETE
		// returns rows in table order, where a retried row lies after
		// its key's later ones): lists and replays go by the outbox id
		// (or, for a replayed event, the one it was first written with,
		// in dead_replays), so a key's replayed events keep their order
		// (G3).
		//
		// Only while the instance row carries this process's token ($4),
		// and only on shards still under the take the round was read
		// under (their epochs, $5, by shard): a record stalled past the
		// lease would otherwise move an event that another relay, or a
		// successor under the same id, published meanwhile
		// (dead-lettered and published, a replay after its key's later
		// events), even if this relay took the shard back since. Those
		// shards' rows stay locked (FOR KEY SHARE) until the record
		// commits: the checks hold at the statement's snapshot only, and
		// the record's transaction may stay open past the lease (a later
		// statement of its batch waiting on a row lock); meanwhile the
		// moved events look pending to every other session, and a relay
		// that took the shards would publish them. A take skips locked
		// rows (FOR UPDATE SKIP LOCKED); a renewal does not wait on them.
		deadSQL: `WITH held AS MATERIALIZED (
    SELECT s.shard FROM ` + shards + ` s
    WHERE s.shard = ANY (ARRAY(SELECT DISTINCT o.shard FROM ` + outbox + ` o WHERE o.id = ANY($1::bigint[])))
        AND s.owner = $3 AND s.lease_until > now() AND s.epoch = ($5::bigint[])[s.shard + 1]
        AND EXISTS (SELECT 1 FROM ` + instances + ` i WHERE i.id = $3 AND i.token = $4)
    FOR KEY SHARE OF s),
moved AS (
    DELETE FROM ` + outbox + ` o USING unnest($1::bigint[], $2::text[]) AS x(id, error)
    WHERE o.id = x.id AND o.shard = ANY (ARRAY(SELECT shard FROM held))
    RETURNING o.id, o.event_id, o.topic, o.key, o.value, o.headers, o.created_at, o.attempts, x.error)
INSERT INTO ` + dead + ` (outbox_id, event_id, topic, key, value, headers, created_at, attempts, error)
SELECT id, event_id, topic, key, value, headers, created_at, attempts + 1, error FROM moved ORDER BY id`,
		// A run of one refusal (x.run > 0) goes on while the same answer
		// comes back and starts again on another; any other outcome
		// (x.run = 0) ends it; x.run = -1 (not sent: an earlier event of
		// its key failed) leaves it as it is. An event not charged
		// (x.charge false: a later failed event of its key, see judge)
		// keeps its attempts and error, and its row is not written at all
		// unless a run must end: a round of a stuck key's events is one
		// row version, not 1,000 (three index entries each).
		failSQL: `UPDATE ` + outbox + ` o SET last_error = CASE WHEN x.charge THEN x.error ELSE o.last_error END,
    attempts = o.attempts + x.charge::int,
    first_refused_at = CASE WHEN x.run < 0 THEN o.first_refused_at WHEN x.run = 0 THEN NULL
        WHEN o.refused_kind = x.run THEN coalesce(o.first_refused_at, now()) ELSE now() END,
    refused_kind = CASE WHEN x.run < 0 THEN o.refused_kind WHEN x.run = 0 THEN NULL ELSE x.run END
FROM unnest($1::bigint[], $2::text[], $3::smallint[], $4::boolean[]) AS x(id, error, run, charge)
WHERE o.id = x.id AND (x.charge OR x.run = 0 AND o.first_refused_at IS NOT NULL)`,
		// The instance row carries the token of the process that holds
		// it: a process with another token gets it only once its lease
		// has lapsed (no row comes back otherwise: the id is in use).
		heartbeatSQL: `INSERT INTO ` + instances + ` AS i (id, hostname, pid, lease_until, token, kafka_ok)
VALUES ($1, $2, $3, now() + $4::interval, $5, $6)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), lease_until = excluded.lease_until,
    hostname = excluded.hostname, pid = excluded.pid, token = excluded.token, kafka_ok = excluded.kafka_ok,
    started_at = CASE WHEN i.token IS NOT DISTINCT FROM excluded.token THEN i.started_at ELSE now() END
WHERE i.token IS NOT DISTINCT FROM excluded.token OR i.lease_until <= now()
RETURNING true`,
		holderSQL: `SELECT hostname, pid, heartbeat_at FROM ` + instances + ` WHERE id = $1`,
		// With the rows of relay_shards: the relays only update them, so
		// a row deleted by hand would leave its shard's keys waiting for
		// good (restoreShardsSQL writes it back).
		liveInstancesSQL: `SELECT count(*), count(*) FILTER (WHERE kafka_ok), (SELECT count(*) FROM ` + shards + `)
FROM ` + instances + ` WHERE lease_until > now()`,
		restoreShardsSQL: `INSERT INTO ` + shards + ` (shard) SELECT g::smallint FROM generate_series(0, ` + strconv.Itoa(NumShards-1) + `) g
ON CONFLICT (shard) DO NOTHING`,
		// A renewal extends only the takes this process made ($3 and $4:
		// shards and their epochs), not every live lease under its id: a
		// successor under the same id (a restart, its predecessor frozen
		// with a dead letter's record open) must take the shards, under
		// new epochs, and a take skips the rows that record holds locked
		// (deadSQL). So must a take whose answer this process lost.
		renewSQL: `UPDATE ` + shards + ` s SET lease_until = now() + $2::interval
FROM unnest($3::smallint[], $4::bigint[]) AS x(shard, epoch)
WHERE s.shard = x.shard AND s.epoch = x.epoch AND s.owner = $1 AND s.lease_until > now()
RETURNING s.shard, s.lease_until, s.epoch`,
		// Every take gives the shard an epoch greater than any it had,
		// even a take back of this relay's own lapsed lease (see
		// deadSQL): the database clock's microseconds, or one more than
		// the last. Not a count from the row's: a row deleted by hand
		// and written back (restoreShardsSQL), or a migration reverted
		// and applied again, starts at 0, and a count would come back to
		// an epoch a stalled record still checks.
		takeSQL: `UPDATE ` + shards + ` SET owner = $1, lease_until = now() + $2::interval,
    epoch = greatest(epoch + 1, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)
WHERE shard IN (
    SELECT shard FROM ` + shards + `
    WHERE owner IS NULL OR lease_until <= now()
    ORDER BY (owner = $1) DESC NULLS LAST, shard
    LIMIT $3
    FOR UPDATE SKIP LOCKED)
RETURNING shard, lease_until, epoch`,
		// A hand-back, only while the instance row carries this process's
		// token ($3): a stalled earlier process's would free the shards
		// its successor under the same id holds, and another relay would
		// publish their events beside it.
		releaseSQL: `UPDATE ` + shards + ` SET owner = NULL, lease_until = NULL WHERE owner = $1 AND shard = ANY($2::smallint[])
    AND EXISTS (SELECT 1 FROM ` + instances + ` WHERE id = $1 AND token = $3)`,
		// The goodbye (releaseAll): one transaction, and only while the
		// instance row still carries this process's token ($2). A
		// successor that took the id after this relay's lease lapsed owns
		// the shards, the rounds and the row now. ownInstanceSQL locks the
		// row, so no successor takes it between the statements.
		ownInstanceSQL: `SELECT true FROM ` + instances + ` WHERE id = $1 AND token = $2 FOR UPDATE`,
		releaseAllSQL: `UPDATE ` + shards + ` SET owner = NULL, lease_until = NULL
WHERE owner = $1 AND EXISTS (SELECT 1 FROM ` + instances + ` WHERE id = $1 AND token = $2)`,
		// With the instance row gone (deleted by hand), the goodbye writes
		// it back with this process's token (lapsed, and deleted again by
		// goodbyeSQL) unless another process did meanwhile; it then
		// releases the shards ($2) still at the epochs of this process's
		// takes ($3): a shard taken since, even by another process under
		// the same id, has a greater epoch.
		instanceBackSQL: `INSERT INTO ` + instances + ` (id, hostname, pid, lease_until, token) VALUES ($1, $2, $3, now(), $4)
ON CONFLICT (id) DO NOTHING RETURNING true`,
		releaseLeasesSQL: `UPDATE ` + shards + ` s SET owner = NULL, lease_until = NULL
FROM unnest($2::smallint[], $3::bigint[]) AS x(shard, epoch)
WHERE s.shard = x.shard AND s.owner = $1 AND s.epoch = x.epoch`,
		goodbyeSQL: `DELETE FROM ` + instances + ` WHERE id = $1 AND token = $2`,
		landedSQL:  `DELETE FROM ` + rounds + ` WHERE instance = $1 AND lo = $2 AND hi = $3`,
		forgetRoundsSQL: `DELETE FROM ` + rounds + ` WHERE instance = $1
    AND EXISTS (SELECT 1 FROM ` + instances + ` WHERE id = $1 AND token = $2)`,
		// A crashed round's rows that another session holds locked (an
		// operator's open transaction, the dead host's backend that has
		// not noticed its client is gone) are skipped, uncharged for that
		// crash: waiting for them would stop the relays taking shards.
		// The charged rows are updated through the primary key, named as
		// an array: joined to the CTE, which PostgreSQL estimates at
		// hundreds of thousands of rows on a large outbox, they were
		// updated through a hash of the whole table (0.3 s at 350,000
		// rows, for one round's 1,000 ids). Both charges run with JIT off
		// (leases.chargeStatement).
		chargeOwnSQL: `WITH crashed AS (
    DELETE FROM ` + rounds + ` WHERE instance = $1 RETURNING lo, hi, shards),
charged AS (
    SELECT o.id FROM ` + outbox + ` o JOIN crashed c ON o.id BETWEEN c.lo AND c.hi AND o.shard = ANY(c.shards)
    FOR UPDATE OF o SKIP LOCKED)
UPDATE ` + outbox + ` o SET attempts = o.attempts + 1, last_error = coalesce(o.last_error, 'relay died while publishing')
WHERE o.id = ANY (ARRAY(SELECT id FROM charged))`,
		// A round whose relay's lease lapsed (or whose instance row is gone)
		// was cut short.
		chargeCrashedSQL: `WITH crashed AS (
    DELETE FROM ` + rounds + ` r
    WHERE NOT EXISTS (SELECT 1 FROM ` + instances + ` i WHERE i.id = r.instance AND i.lease_until > now())
    RETURNING lo, hi, shards),
charged AS (
    SELECT o.id FROM ` + outbox + ` o JOIN crashed c ON o.id BETWEEN c.lo AND c.hi AND o.shard = ANY(c.shards)
    FOR UPDATE OF o SKIP LOCKED)
UPDATE ` + outbox + ` o SET attempts = o.attempts + 1, last_error = coalesce(o.last_error, 'relay died while publishing')
WHERE o.id = ANY (ARRAY(SELECT id FROM charged))`,
		forgetOldSQL: `DELETE FROM ` + instances + ` WHERE lease_until < now() - interval '1 hour'`,
	}
}

// The claim reads a round: the oldest pending events of the shards this
// relay owns, in id order, leaving out excluded ids (rounds in flight,
// keyless events waiting out a retry) and, for each key waiting out a retry,
// its failed event and every later one. It touches only what the relay may
// publish: its cost does not grow with the number of relays, with other
// shards' backlog, or with a blocked key's backlog. Three shapes:
//
//   - The relay owns every shard and no key is blocked (one relay): the
//     primary key in id order (claimAllQuery), no shard filter at all,
//     from a floor proof's id when one holds every shard (claimproof.go).
//   - Otherwise each owned shard without a blocked key is one index range
//     of outbox_shard_id_idx, (shard, id). Up to a quarter of the shards,
//     PostgreSQL merges them in id order (a Merge Append that reads each
//     range only as far as the round needs: about one row per shard beyond
//     the round). Built per set of shards, with the shard numbers as
//     literals (claimShardsQuery), each from a floor proof's id where one
//     holds the shard (claimproof.go). More of them (the relay owns every shard
//     but one holds a blocked key) are read by one LATERAL with the shards
//     as a parameter, each its share of the round (claimFreeQuery): a
//     255-branch merge took 50-190 ms to plan and ran slower. When at most
//     claimFloorMaxOut shards are not free and the last round was whole,
//     the free shards are read through the primary key in id order from
//     their lowest pending id instead (claimFloorQuery), stepping over a
//     blocked key's events below it, and reading the other keys of the
//     shards holding blocked keys with them; where that read comes short,
//     by the shares.
//   - A shard holding blocked keys is read through outbox_key_hash_idx, on
//     the first 8 bytes of the same sha256 the shard comes from (its first
//     byte is the shard): the key-hash ranges between the blocked keys' hashes,
//     plus each blocked key's events before its failed one, so a key stuck
//     with 300,000 events is never walked (claimBlockedQuery). The ranges
//     are read in index order, (key hash, id), only as far as the round
//     needs, starting where the shard's last claim stopped (a sweep over
//     the key hashes, so every key gets its turn), instead of reading the
//     whole shard and sorting it by id. Each key's events still come in id
//     order. Another key sharing a blocked key's 8-byte hash waits with
//     it: held back, never reordered. Beside a floor read, it reads only
//     below the floor's base, and the claim merges the two (mergeBlocked).
//
// Excluded ids are a NOT IN list ($1), which PostgreSQL runs as a hashed
// subplan whatever the plan ("= ANY($array)" becomes a linear search per
// row once a prepared statement goes to a generic plan). When they form one
// run of consecutive ids ($1 to $3) and the relay owns every shard, no other
// row can lie inside the run, so the read is two index ranges, below and
// above it, merged in id order: the common case of one relay draining a
// backlog.

const claimColumns = `o.id, o.event_id, o.topic, o.key, o.value, o.headers, o.created_at,
       extract(epoch FROM now() - o.first_refused_at)::float8 AS refused_for, o.refused_kind,
       coalesce(octet_length(o.key), 0) + coalesce(octet_length(o.value), 0) + coalesce(pg_column_size(o.headers), 0) AS size`

// keyHashSQL is outbox_key_hash_idx's expression.
const keyHashSQL = `substring(sha256(coalesce(o.key, uuid_send(o.event_id))) FROM 1 FOR 8)`

// claimAllQuery reads the oldest pending events through the primary key,
// leaving out the excluded ids ($1), or, with run, those from $1 to $2.
// The limit is a literal: with "LIMIT $n" PostgreSQL planned every claim
// afresh (a custom plan each time, 0.3 ms), where with the literal it keeps
// the generic plan after five (the same plan).
//
// With bounded, the read starts at an id C (the last parameter: $2, or $3
// with run), the id of a floor proof that holds every shard
// (claimproof.go): no row below C is pending or ever will be, so the read
// is the same, but it descends to C once instead of walking from the
// index's left edge past every entry deleted since the last vacuum (one
// buffer per ~370 deleted rows: 4,000 buffers a claim 1.5M rows into a
// drain, where autovacuum never runs).
//
// With shard, each row carries its shard after claimColumns (a held read:
// isHeld hashes only the keys of the blocked keys' shards).
func claimAllQuery(outbox string, run, bounded, shard bool, limit int) string {
	columns := claimColumns
	if shard {
		columns += `, o.shard`
	}
	read := func(where string) string {
		return `SELECT ` + columns + `
FROM ` + outbox + ` o
WHERE ` + where + `
ORDER BY o.id
LIMIT ` + strconv.Itoa(limit)
	}
	if !run {
		if bounded {
			return read(`o.id >= $2 AND o.id NOT IN (SELECT unnest($1::bigint[]))`)
		}
		return read(`o.id NOT IN (SELECT unnest($1::bigint[]))`)
	}
	below, above := `o.id < $1`, `o.id > $2`
	if bounded {
		below, above = `o.id >= $3 AND `+below, `o.id >= $3 AND `+above
	}
	return `SELECT * FROM (
(` + read(below) + `)
UNION ALL
(` + read(above) + `)
) AS round
ORDER BY id
LIMIT ` + strconv.Itoa(limit)
}

// claimShardsQuery reads shards (not empty) as one index range each, merged
// in id order: each range is its own subquery with ORDER BY and LIMIT, the
// shape PostgreSQL turns into a Merge Append of index scans that reads each
// range only as far as the merge needs. The merge is fenced by its LIMIT, so
// the NOT IN ($1) is evaluated once above it, with one hash table, not once
// per shard; inner is the round's size plus room for the excluded ids. The
// final ORDER BY keeps the merge's order (no sort) and makes it what the
// byte bound's running sum reads without sorting the round again. The
// limits are literals: with "LIMIT $n" a generic plan assumes a tenth of the
// table is wanted and sorts every owned row instead.
//
// Each range starts at its shard's entry of $2: the id of a floor proof
// that holds the shard (claimproof.go), below which nothing in it is
// pending or ever will be, or math.MinInt64, the range's left edge. Without it each range is read
// from the left edge, past the index entries of every row deleted since the
// last vacuum: a relay owning a quarter of the shards read 2,161 buffers a
// claim, not 1,212, once three quarters of a 1M backlog were drained.
func claimShardsQuery(outbox string, shards []int16, inner, limit int) string {
	var b strings.Builder
	b.WriteString(`SELECT * FROM (SELECT * FROM (`)
	for i, sh := range shards {
		if i > 0 {
			b.WriteString(`
UNION ALL `)
		}
		fmt.Fprintf(&b, `(SELECT `+claimColumns+` FROM %s o WHERE o.shard = %d AND o.id >= ($2::bigint[])[%d] ORDER BY o.id LIMIT %d)`, outbox, sh, i+1, inner)
	}
	fmt.Fprintf(&b, `
) AS m ORDER BY m.id LIMIT %d) AS m
WHERE m.id NOT IN (SELECT unnest($1::bigint[]))
ORDER BY m.id
LIMIT %d`, inner, limit)
	return b.String()
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
	stmts := s.claimStatements(shards, limit, blockedKeys, excluded)
	out := make([]pendingEvent, 0, limit)
	b := &pgx.Batch{}
	// Local to the batch's implicit transaction: the statements after it
	// are planned with these, and they end with the batch. Each claim
	// statement runs its generic plan from its first execution on, the
	// plan plan_test.go checks: left to choose, PostgreSQL kept custom
	// plans for good for the blocked shards' read (its generic estimate is
	// the higher: 1.5 ms of planning in a 2 ms read, every claim), and
	// planned a relay's read of a quarter of the shards (64 index ranges,
	// 5 ms a plan) five times per pool connection before taking it. One
	// relay's read of every shard (claimAll) takes its generic plan after
	// five and needs no extra statement.
	generic, noBitmap := false, false
	for _, st := range stmts {
		generic = generic || !st.all
		noBitmap = noBitmap || st.noBitmap
	}
	switch {
	case noBitmap: // see claimBlockedQuery
		b.Queue(`SELECT set_config('enable_bitmapscan', 'off', true), set_config('plan_cache_mode', 'force_generic_plan', true)`)
	case generic:
		b.Queue(`SELECT set_config('plan_cache_mode', 'force_generic_plan', true)`)
	}
	read := make([][2]int, len(stmts)) // each statement's rows in out
	heldDropped := 0                   // a held read's rows dropped (isHeld)
	floor, floorRead, guarded := false, false, false
	for i, st := range stmts {
		guarded = guarded || st.guarded
		b.Queue(st.sql, st.args...).Query(func(rows pgx.Rows) error {
			var err error
			read[i][0] = len(out)
			out, err = scanEvents(rows, out)
			if st.held != nil {
				shards := heldShards(st.held)
				kept := read[i][0]
				for j := read[i][0]; j < len(out); j++ {
					if out[j].shard >= 0 && !shards.has(out[j].shard) || !isHeld(&out[j], st.held) {
						out[kept] = out[j]
						kept++
					}
				}
				heldDropped, out = len(out)-kept, out[:kept]
			}
			read[i][1] = len(out)
			if st.sweepLimit > 0 {
				for j := read[i][0]; j < read[i][1]; j++ {
					out[j].swept = true
				}
			}
			return err
		})
		floor = floor || st.floor || st.all || st.shards
		floorRead = floorRead || st.floor && st.held == nil
	}
	if floor {
		// Floor reads, claimAll and claimShards reads alike keep a floor
		// proof going.
		if err := s.proofSequence(ctx); err != nil {
			return nil, err
		}
		s.queueFloorProof(b, floorRead)
	}
	if b.Len() > 0 {
		if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
			return nil, err
		}
	}
	if heldDropped > limit/heldDenseDiv {
		// A held read met the blocked keys' events above the floor (the
		// floor's base lags the rounds, or a stuck key still gets new
		// events): the floor read leaves them out in SQL, and walks twice
		// the round, for the next claims; this one too, where it dropped
		// more than half the round. Nothing is recorded yet.
		s.heldOff = claimFloorOff
		if heldDropped > limit/2 {
			return s.claim(ctx, owner, shards, limit, blockedKeys, excluded)
		}
	}
	var adapt *statement
	var floorFrom int64 // the lowest id a floor read read, 0 if none
	for i := range stmts {
		st := &stmts[i]
		if (st.all || st.shards) && read[i][1] > read[i][0] {
			floorFrom = out[read[i][0]].id // in id order; what the byte bound keeps starts there too
		}
		if st.exact != nil {
			// A guarded read, the claim's only statement (claimAll): bound
			// it here; if the bound keeps an event it withheld, read
			// exactly, and so for the next claims, for a while (large
			// events are about).
			keep, whole := cutBytes(out, s.maxBytes)
			if whole {
				out = out[:keep]
				continue
			}
			s.exactOff = claimExactOff
			rows, err := s.pool.Query(ctx, st.exact.sql, st.exact.args...)
			if err != nil {
				return nil, err
			}
			if out, err = scanEvents(rows, out[:0]); err != nil {
				return nil, err
			}
			continue
		}
		if st.free != nil {
			adapt = st
		}
		if st.floor && read[i][1] > read[i][0] {
			floorFrom = out[read[i][0]].id // in id order
		}
		if st.short == nil {
			continue
		}
		// A held read that read a whole round did not come short, though
		// it keeps less of it.
		if kept := out[read[i][0]:read[i][1]]; len(kept)+heldDropped >= limit || !st.guarded && !s.floorCameShort(kept, limit) {
			continue
		}
		// Short of the round: at the end of the backlog (nothing free
		// above what it read), or stopped by its walk's bound.
		above := int64(0)
		if read[i][1] > read[i][0] {
			above = out[read[i][1]-1].id
		}
		more, err := s.freeAbove(ctx, st.short.free, above, excluded)
		if err != nil {
			return nil, err
		}
		if !more {
			continue
		}
		floorFrom = 0
		// The floor's walk met more rows it may not publish than the
		// round (claimFloorQuery): read the free shards by their shares.
		// The next claims do so directly, for a while (at the end of a
		// backlog too, where they would anyway: its rounds are not whole).
		s.floorOff = claimFloorOff
		heldDropped = 0 // not of this round
		out = slices.Delete(out, read[i][0], read[i][1])
		rows, err := s.pool.Query(ctx, st.short.sql, st.short.args...)
		if err != nil {
			return nil, err
		}
		if out, err = scanEvents(rows, out); err != nil {
			return nil, err
		}
		adapt = st.short
	}
	s.sweptFull = false
	dropped := len(out) + heldDropped
	if len(blockedKeys) > 0 {
		out, s.sweptFull = mergeBlocked(out, stmts)
	}
	dropped -= len(out)
	if len(stmts) > 1 || len(blockedKeys) > 0 || guarded {
		out = dedupByID(sortByID(out))
		if len(out) > limit {
			out = out[:limit]
		}
		if s.maxBytes > 0 {
			keep, whole := cutBytes(out, s.maxBytes)
			if !whole {
				// The bound keeps an event a guarded read withheld: claim
				// again, exactly, and so for the next claims, for a while
				// (large events are about). Nothing is recorded yet.
				s.exactOff = claimExactOff
				return s.claim(ctx, owner, shards, limit, blockedKeys, excluded)
			}
			out = out[:keep]
		}
	}
	s.advanceSweeps(out, blockedKeys)
	s.noteFloor(floorFrom)
	if p := s.proving; p != nil && p.ownFloor {
		p.below, p.ownFloor = min(p.below, floorFrom), false
	}
	if adapt != nil {
		s.adaptFreeKs(adapt.free, adapt.ks, out)
	}
	// A round short only of the rows mergeBlocked dropped read a whole
	// round: the next claim reads from the floor again, its key-hash read
	// a whole round's worth (sweptFull).
	s.lastFull = len(out) == limit || dropped > 0 && len(out)+dropped >= limit
	if len(out) > 0 {
		k := keyOf(out)
		if _, err := s.pool.Exec(ctx, s.markSQL, owner, k.lo, k.hi, shards); err != nil {
			return nil, fmt.Errorf("record the round in flight: %w", err)
		}
	}
	return out, nil
}

// heldDenseDiv: a held read that drops more than its round over this
// (isHeld) gives way to the floor read for claimFloorOff claims.
const heldDenseDiv = 8

// claimAllTexts makes claimAllQuery's texts for a round of limit.
func (s *store) claimAllTexts(limit int) {
	if limit == s.claimAllLimit {
		return
	}
	for run := range 2 {
		for bounded := range 2 {
			s.claimAllSQL[run][bounded] = claimAllQuery(s.outbox, run == 1, bounded == 1, false, limit)
		}
		s.claimHeldSQL[run] = claimAllQuery(s.outbox, run == 1, true, true, limit)
	}
	s.claimAllLimit = limit
}

// shardSet is a set of shards.
type shardSet [NumShards / 64]uint64

func (s *shardSet) has(sh int16) bool { return s[sh/64]&(1<<(sh%64)) != 0 }

// heldShards returns the shards of held's key hashes (a hash's first byte is
// its shard): a held read's rows of other shards are not held, and their
// keys need no hashing (isHeld: 6 ms of the relay's CPU in a drain of
// 50,000 events beside a stuck key, a claim's critical path).
func heldShards(held map[string]int64) *shardSet {
	var s shardSet
	for h := range held {
		s[h[0]/64] |= 1 << (h[0] % 64)
	}
	return &s
}

// isHeld reports whether e's key has a hash in held (heldBack) and e is at or
// after the id that hash is held back from: what claimFloorQuery leaves out.
// By the hash, not the key: the key-hash read below the floor's base leaves
// out every key of a blocked key's hash, so such a key's later events must
// wait too (120 ns a row here). A withheld event's key is not known: it is
// kept, and the claim reads exactly if the round's bound keeps it (claim).
// A keyless event is kept: keyless events are held back by id
// (Relay.exclusions), and have no order to keep.
func isHeld(e *pendingEvent, held map[string]int64) bool {
	if e.withheld || e.key == nil {
		return false
	}
	h := sha256.Sum256(e.key)
	from, ok := held[string(h[:8])]
	return ok && e.id >= from
}

// statement is one SQL statement and its arguments.
type statement struct {
	sql  string
	args []any
	// noBitmap: plan it with enable_bitmapscan off (see claimBlockedQuery),
	// on its generic plan.
	noBitmap bool
	// free and ks: a claimFreeQuery read of the free shards with these
	// limits (for adaptFreeKs).
	free []int16
	ks   []int32
	// short: read instead if this read comes short (claimFloorQuery).
	short *statement
	floor bool // a claimFloorQuery read, or a held read
	// held: a held read (claimStatements): the claim drops from its rows
	// the events of the keys of these hashes (heldBack) from the id each is
	// held back from on (isHeld).
	held map[string]int64
	// all: a claimAllQuery read; like a floor read, it records the
	// lowest id it read (store.noteFloor) and carries a floor proof on.
	all bool
	// shards: a claimShardsQuery read; it does the same, its ranges
	// starting at the proof's id in the shards the proof holds.
	shards bool
	// exact: read instead if this guarded read (guardBytes) withheld an
	// event the byte bound keeps.
	exact *statement
	// guard: a read of a round in id order whose byte bound may be kept
	// on the client (guardBytes) rather than by a running sum: a floor
	// read, the read of the shards of a relay that owns some (merged, or
	// by their shares), or the read of the shards holding blocked keys
	// (claimBlockedQuery; see mergeBlocked).
	guard bool
	// guarded: a guarded read (guardBytes), alone or among others: the
	// claim bounds the round they make (cutBytes) and claims again exactly
	// if it keeps an event this one withheld.
	guarded bool
	// sweepLimit: the limit of a read of the shards holding blocked keys
	// (claimBlockedQuery), sweptShards those shards; belowBase: that read
	// reads their key-hash ranges below a floor read's base only, the
	// floor read having the rest (mergeBlocked).
	sweepLimit  int
	belowBase   bool
	sweptShards []int16
	// boundInSQL: the read's rows are bound by bytes in SQL (boundBytes),
	// so it may have stopped short of its limit for that.
	boundInSQL bool
}

// claimStatements returns the one or two reads of a claim (see claimAllQuery).
func (s *store) claimStatements(shards []int16, limit int, blockedKeys []keyBlock, excluded []int64) []statement {
	s.claimN++
	s.proofShards = nil
	var segs map[int16][]segment
	if len(blockedKeys) > 0 {
		segs = blockedSegments(blockedKeys)
	}
	free := shards
	var blockedShards []int16 // owned
	if len(segs) > 0 {
		free = make([]int16, 0, len(shards))
		for _, sh := range shards {
			if _, found := segs[sh]; found {
				blockedShards = append(blockedShards, sh)
			} else {
				free = append(free, sh)
			}
		}
	}
	for sh := range s.sweep {
		if _, found := slices.BinarySearch(blockedShards, sh); !found {
			delete(s.sweep, sh)
		}
	}
	if excluded == nil {
		excluded = []int64{}
	}
	// Room for the excluded ids: at least two rounds' worth (a read-ahead
	// leaves out the round in flight and the one being recorded), more
	// rounded up to a power of two. One text for a fresh read and a
	// read-ahead alike: each text is prepared, and planned five times
	// before its generic plan, on every pool connection (a 64-shard plan
	// costs 10-15 ms); the LIMITs cost nothing when not reached.
	inner := limit + 1<<bits.Len(uint(max(len(excluded), 2*limit)-1))
	var out []statement
	var runs [][2]int64
	var rest []int64
	below, besideFloor := int64(math.MaxInt64), false // see claimBlockedQuery
	if len(blockedShards) > 0 || len(free) > claimFreeMin && len(free) < NumShards {
		runs, rest = skipRuns(slices.Clone(excluded))
	}
	if s.floorOff > 0 {
		s.floorOff--
	}
	if s.heldOff > 0 {
		s.heldOff--
	}
	// Reads are guarded (guardBytes) where the round's bytes are bound,
	// its share of them is large enough, and no guarded read lately kept
	// an event it withheld (exactOff).
	var share int64
	if s.maxBytes > 0 {
		share = s.maxBytes / int64(limit)
	}
	guard := s.maxBytes > 0 && share >= minGuardShare && s.exactOff == 0
	switch {
	case len(free) == NumShards:
		s.claimAllTexts(limit)
		s.floorShape(shapeAll)
		bounded := 0
		if s.proof.holdsAll() {
			bounded = 1
			s.runUsed = true
		}
		st := statement{sql: s.claimAllSQL[0][bounded], args: []any{excluded}, all: true}
		if runLo, runHi, ok := oneRun(excluded); ok {
			st = statement{sql: s.claimAllSQL[1][bounded], args: []any{runLo, runHi}, all: true}
		}
		if bounded == 1 {
			st.args = append(st.args, s.proof.below)
		}
		if guard {
			exact := boundBytes(st, s.maxBytes)
			st = guardBytes(st, share)
			st.exact = &exact
		}
		out = append(out, st)
	case len(free) > claimFreeMin:
		if limit != s.claimFreeLimit || s.claimFreeSQL == "" {
			s.claimFreeSQL = claimFreeQuery(s.outbox, limit)
			s.claimFloorSQL = claimFloorQuery(s.outbox, limit, claimFloorSkips+1)
			s.claimFreeLimit = limit
		}
		free := slices.Clone(free)
		ks := s.freeKs(free, limit)
		shares := statement{sql: s.claimFreeSQL, args: []any{free, ks, excluded}, free: free, ks: ks}
		if s.lastFull && NumShards-len(free) <= claimFloorMaxOut && s.floorOff == 0 {
			s.floorShape(shapeFloor)
			descend, base := s.descents(free, s.floorBase())
			s.runUsed = s.runUsed || s.proof.below != 0
			// The shards holding blocked keys are read with the free ones
			// (mergeBlocked) unless the round's bytes are bound in SQL: the
			// key-hash read may then stop short of its limit for that, and
			// the merge would drop their rows from every round.
			withBlocked := s.maxBytes == 0 || guard
			notRead, hashes, froms := notIn(free), [][]byte{}, []int64{}
			if withBlocked {
				notRead = notIn(shards)
				for h, from := range heldBack(blockedKeys) {
					hashes, froms = append(hashes, []byte(h)), append(froms, from)
				}
			}
			if withBlocked {
				below, besideFloor = base, true
			}
			runLo, runHi, isRun := oneRun(slices.Clone(excluded))
			if withBlocked && len(descend) == 0 && len(notRead) == 0 && (isRun || len(excluded) == 0) && s.heldOff == 0 {
				// A held read: the floor read's rows, through one
				// relay's read of every shard (claimAllQuery) from the
				// base, a floor proof holding every free shard and this
				// relay owning every shard, so there is nothing to
				// descend and no shard to leave out; the claim drops the
				// blocked keys' events (isHeld). Per claim beside a stuck
				// key 0.2-0.3 ms of PostgreSQL's time less than the floor
				// read (1.12 against 0.91 ms a read in a drain: its
				// merge, limits and filter cost per row); its text is
				// that read's with each row's shard (claimHeldSQL), so
				// that only the blocked keys' shards' keys are hashed
				// (a text of its own, planned once per pool connection,
				// on its generic plan: the batch forces it). Its walk is
				// bound by the round, where the floor read walks twice
				// that: where it drops many events, the floor read takes
				// over for a while (claim).
				s.claimAllTexts(limit)
				st := statement{sql: s.claimHeldSQL[0], args: []any{excluded, base}, short: &shares, floor: true, guard: true, held: heldBack(blockedKeys)}
				if isRun {
					st.sql, st.args = s.claimHeldSQL[1], []any{runLo, runHi, base}
				}
				out = append(out, st)
			} else {
				args := []any{descend, notRead, rest, base}
				for _, r := range floorBranches(runs) {
					args = append(args, r[0], r[1])
				}
				args = append(args, append([]int16{}, blockedShards...), hashes, froms)
				out = append(out, statement{sql: s.claimFloorSQL, args: args, short: &shares, floor: true, guard: true})
			}
		} else {
			shares.guard = true
			out = append(out, shares)
		}
	case len(free) > 0:
		if !slices.Equal(free, s.claimShards) || inner != s.claimInner || limit != s.claimLimit {
			s.claimShards, s.claimInner, s.claimLimit = slices.Clone(free), inner, limit
			s.claimShardsSQL = claimShardsQuery(s.outbox, free, inner, limit)
		}
		s.floorShape(shapeShards)
		s.proofShards = slices.Clone(free)
		from := make([]int64, len(free))
		for i, sh := range free {
			from[i] = math.MinInt64 // the range's left edge, whatever the ids
			if s.proof.holds(sh) {
				from[i] = s.proof.below
				s.runUsed = true
			}
		}
		out = append(out, statement{sql: s.claimShardsSQL, args: []any{excluded, from}, guard: true, shards: true})
	}
	if len(blockedShards) > 0 {
		read := make([][]segment, len(blockedShards))
		for i, sh := range blockedShards {
			from, ok := s.sweep[sh]
			if !ok {
				s.sweep[sh] = nil
			}
			read[i] = heldFirst(rotate(segs[sh], from))
		}
		// While the other shards fill the rounds (the last one was full),
		// the blocked shards' events that make a round are their share of
		// it: read a few times that, not a whole round each, of which the
		// merge by id would keep a handful.
		// Unless the last such read, beside a floor read, stopped at
		// that limit: the floor read's rows of these shards were dropped
		// then (mergeBlocked), and their backlog below the base must
		// drain faster than they fall below it (that round counted as
		// whole all the same: lastFull).
		blockedLimit := limit
		if s.lastFull && len(free) > 0 && !s.sweptFull {
			blockedLimit = min(limit, max(64, 4*limit*len(blockedShards)/len(shards)))
		}
		sql, args := claimBlockedQuery(s.outbox, read, blockedLimit, below)
		blockedExcluded(args, runs, rest)
		// Guarded where the reads may be: a byte bound in SQL may stop it
		// short of its limit, and mergeBlocked must then take it for cut.
		// sweepLimit is the limit without the room claimBlockedQuery adds
		// for the blocked keys' own events: a read that reached it may
		// have been cut in one of its shards, and counts as cut.
		out = append(out, statement{sql: sql, args: args, noBitmap: true, guard: true, sweepLimit: blockedLimit, belowBase: besideFloor, sweptShards: blockedShards})
	}
	if s.exactOff > 0 {
		s.exactOff--
	}
	if s.maxBytes > 0 {
		for i := range out {
			if out[i].exact != nil {
				continue // bound on the client (claim)
			}
			if out[i].guard && guard {
				// As claimAll's read, and for the same reason: the
				// running sum's window cost a third of a floor read
				// beside a stuck key (0.5 of 1.5 ms), a sixth of a
				// quarter of the shards' read.
				short := out[i].short
				out[i] = guardBytes(out[i], share)
				out[i].guarded = true
				if short != nil {
					bound := boundBytes(*short, s.maxBytes)
					out[i].short = &bound
				}
				continue
			}
			out[i] = boundBytes(out[i], s.maxBytes)
			out[i].boundInSQL = true
			if out[i].short != nil {
				short := boundBytes(*out[i].short, s.maxBytes)
				out[i].short = &short
			}
		}
	}
	return out
}

// boundBytes keeps the oldest events of a claim statement's rows whose
// sizes add up to at most maxBytes, and the first event whatever its size.
// The running sum is taken over the rows in id order before their values
// are sent (a large value stays a TOAST pointer until then), so events left
// out cost neither memory nor transfer.
func boundBytes(st statement, maxBytes int64) statement {
	n := len(st.args) + 1
	st.sql = fmt.Sprintf(`SELECT id, event_id, topic, key, value, headers, created_at, refused_for, refused_kind, size FROM (
    SELECT c.*, sum(c.size) OVER (ORDER BY c.id ROWS UNBOUNDED PRECEDING) AS upto FROM (
%s
    ) AS c
) AS w
WHERE w.upto <= $%d OR w.upto = w.size`, st.sql, n)
	st.args = append(slices.Clip(st.args), maxBytes)
	return st
}

// minGuardShare is the least share of the byte bound per event of a round
// (Config.BatchBytes / BatchSize) for which a claim is guarded (guardBytes)
// rather than bound exactly (boundBytes); below it most events would be
// withheld and read twice.
const minGuardShare = 1024

// claimExactOff is how many claims are bound exactly after a guarded one
// withheld an event the bound keeps.
const claimExactOff = 16

// guardBytes is the cheap form of boundBytes: it sends every row of st,
// but the keys, values and headers only of events of at most share bytes
// (the rest come with those NULL and their size negated: withheld), so a
// round transfers at most about BatchSize × share = BatchBytes of them,
// and claim cuts the round at the bound itself (cutBytes). boundBytes'
// running sum made PostgreSQL spool every row of the round through a
// window aggregate: 1.3-1.8 ms of its CPU per 1,000-event claim, as much
// as the read itself.
func guardBytes(st statement, share int64) statement {
	n := len(st.args) + 1
	shard := "" // a held read's rows carry their shard (isHeld)
	if st.held != nil {
		shard = ", shard"
	}
	st.sql = fmt.Sprintf(`SELECT id, event_id, topic,
    CASE WHEN size <= $%[2]d THEN key END AS key,
    CASE WHEN size <= $%[2]d THEN value END AS value,
    CASE WHEN size <= $%[2]d THEN headers END AS headers,
    created_at, refused_for, refused_kind,
    CASE WHEN size <= $%[2]d THEN size ELSE -size END AS size%[3]s
FROM (
%[1]s
) AS c`, st.sql, n, shard)
	st.args = append(slices.Clip(st.args), share)
	return st
}

// cutBytes returns how many of events (in id order) a round bounded by
// maxBytes keeps, as boundBytes does (the oldest that fit, and the first
// whatever its size), and whether none of them was withheld.
func cutBytes(events []pendingEvent, maxBytes int64) (keep int, whole bool) {
	var total int64
	for i := range events {
		if total += events[i].size; i > 0 && total > maxBytes {
			return i, true
		}
		if events[i].withheld {
			return i, false
		}
	}
	return len(events), true
}

// scanEvents appends the claim's rows to out.
func scanEvents(rows pgx.Rows, out []pendingEvent) ([]pendingEvent, error) {
	defer rows.Close()
	// Scanned in place, into the slice's next element and into variables
	// shared by the rows: a pendingEvent of its own per row escaped to the
	// heap (Scan takes pointers as any) and was copied into out.
	// The topic is read as the driver's bytes and shared by the events of
	// one topic, and the event ids' text is cut from slabs: not one
	// allocation per row each.
	// The destinations are one []any for all rows: Scan's variadic slice
	// escapes (an interface method), so passing them per row allocated
	// 160 bytes a row, a tenth of the relay's allocations in a drain.
	var headers []byte
	var eventID [16]byte
	var topic, key, value pgtype.DriverBytes
	var id, size int64
	var createdAt time.Time
	var refusedFor *float64
	var refusedKind *int16
	shard := int16(-1)
	dest := []any{&id, &eventID, &topic, &key, &value, &headers, &createdAt, &refusedFor, &refusedKind, &size, &shard}
	first := true
	var topics map[string]string
	var slab, data []byte
	for rows.Next() {
		// pgx scans a non-NULL value into a new allocation; nil here
		// makes sure no event shares the previous one's.
		refusedFor, refusedKind = nil, nil
		if first { // known once a row is (a batch's failed statement has none)
			if len(rows.FieldDescriptions()) < len(dest) { // no shard column
				dest = dest[:len(dest)-1]
			}
			first = false
		}
		if err := rows.Scan(dest...); err != nil {
			return out, err
		}
		out = append(out, pendingEvent{id: id, createdAt: createdAt, refusedFor: refusedFor, refusedKind: refusedKind, size: size, shard: shard})
		e := &out[len(out)-1]
		e.key, data = copyOut(key, data)
		e.value, data = copyOut(value, data)
		if t, ok := topics[string(topic)]; ok {
			e.topic = t
		} else {
			if topics == nil {
				topics = map[string]string{}
			}
			e.topic = string(topic)
			topics[e.topic] = e.topic
		}
		if len(slab)+uuidLen > cap(slab) {
			slab = make([]byte, 0, 256*uuidLen)
		}
		slab = slab[:len(slab)+uuidLen]
		e.eventID = slab[len(slab)-uuidLen : len(slab) : len(slab)]
		putUUID(e.eventID, eventID)
		if e.size < 0 {
			e.size, e.withheld = -e.size, true
		}
		if len(headers) > 0 {
			if err := json.Unmarshal(headers, &e.headers); err != nil {
				// The table's CHECK refuses such headers at INSERT
				// (before migration 7 it let arrays of strings through:
				// rows written then may still be pending); publish
				// them as one header rather than stall.
				e.headers = map[string]string{"onceflow-bad-headers": string(headers)}
			}
		}
	}
	return out, rows.Err()
}

// dataSlab is the size of the slabs a claim's keys and values are copied
// into; a larger one gets an allocation of its own.
const dataSlab = 64 << 10

// copyOut copies b (the driver's bytes, valid until the next row) into the
// slab data, or into an allocation of its own if larger than a quarter of a
// slab, and returns the copy (nil for nil: SQL NULL) and the slab.
func copyOut(b pgtype.DriverBytes, data []byte) ([]byte, []byte) {
	if b == nil {
		return nil, data
	}
	n := len(b)
	if n == 0 {
		return []byte{}, data // empty, not NULL
	}
	if n > dataSlab/4 {
		return append([]byte(nil), b...), data
	}
	if len(data)+n > cap(data) {
		data = make([]byte, 0, dataSlab)
	}
	data = append(data, b...)
	return data[len(data)-n : len(data) : len(data)], data
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
	b := make([]byte, uuidLen)
	putUUID(b, u)
	return b
}

// uuidLen is the length of a UUID's canonical text.
const uuidLen = 36

// putUUID writes u's canonical text into b (uuidLen bytes).
func putUUID(b []byte, u [16]byte) {
	hex.Encode(b[0:8], u[0:4])
	b[8] = '-'
	hex.Encode(b[9:13], u[4:6])
	b[13] = '-'
	hex.Encode(b[14:18], u[6:8])
	b[18] = '-'
	hex.Encode(b[19:23], u[8:10])
	b[23] = '-'
	hex.Encode(b[24:], u[10:])
}

// finished is what finish recorded of a round.
type finished struct {
	deleted int64 // acknowledged events deleted
	// leftToOthers are acknowledged events left in the outbox on shards
	// this relay no longer holds, for their new owner; the others not
	// deleted were gone already (by hand, or published and deleted by a
	// relay that took their shard).
	leftToOthers int64
	deadMoved    int64 // refused events moved to outbox_dead
}

// finish records one round's outcome in one round trip: deletes the
// acknowledged events and moves the refused ones to outbox_dead (both only
// on shards this relay still owns), and notes the errors of the ones to
// retry. shards are the shards the round was read from, sorted, and
// epochs, by shard, the epochs they were held under when it was read
// (leases.epochsOf): nil, and no refused event is moved. round is its
// relay_rounds row.
func (s *store) finish(ctx context.Context, owner string, shards []int16, epochs []int64, acked []int64, dead []deadEvent, failed []failedEvent, round roundKey) (f finished, err error) {
	b := &pgx.Batch{}
	// Generic plans, as for the claims (local to the batch's implicit
	// transaction): beside a large backlog PostgreSQL kept a custom plan
	// for the deletes on every round (the generic estimate of a range of
	// the primary key grows with the table), 0.15 ms of planning a round.
	// A lock_timeout (recordLockWait): a record with dead letters holds
	// their shards' rows locked until it commits (deadSQL), and no relay
	// can take them meanwhile; waiting on an operator's lock, its relay
	// frozen (the record's own timeout is a cancel that never comes), it
	// would hold them for as long as that lock lasts. A record that fails
	// leaves its events pending.
	lockWait := s.recordLockWait
	if lockWait == "" {
		lockWait = "0"
	}
	b.Queue(`SELECT set_config('plan_cache_mode', 'force_generic_plan', true), set_config('lock_timeout', $1, true)`, lockWait)
	if len(acked) > 0 {
		count := func(tag pgconn.CommandTag) error {
			f.deleted += tag.RowsAffected()
			return nil
		}
		// The longest run of consecutive ids by a range of the primary
		// key, the rest by "= ANY": a round read beside a blocked key is
		// usually one run.
		lo, hi, rest := longestRun(acked)
		if hi-lo+1 >= minDeleteRun {
			b.Queue(s.deleteRunSQL, lo, hi, owner, shards).Exec(count)
		} else {
			rest = acked
		}
		if len(rest) > 0 {
			b.Queue(s.deleteSQL, rest, owner, shards).Exec(count)
		}
	}
	if len(dead) > 0 && epochs != nil {
		ids := make([]int64, len(dead))
		errs := make([]string, len(dead))
		for i, d := range dead {
			ids[i], errs[i] = d.id, d.err
		}
		b.Queue(s.deadSQL, ids, errs, owner, s.token, epochs).Exec(func(tag pgconn.CommandTag) error {
			f.deadMoved = tag.RowsAffected()
			return nil
		})
	}
	var ids []int64
	var errs []string
	var runs []int16
	var charges []bool
	for _, f := range failed {
		// An event not charged is written only to end the refusal run
		// its row was in when read, so a stuck key's round of 1,000 events
		// sends (and probes the primary key for) its first event alone.
		if !f.charge && (f.run != runReset || !f.inRun) {
			continue
		}
		ids, errs = append(ids, f.id), append(errs, f.err)
		runs, charges = append(runs, int16(f.run)), append(charges, f.charge)
	}
	if len(ids) > 0 {
		b.Queue(s.failSQL, ids, errs, runs, charges)
	}
	b.Queue(s.landedSQL, owner, round.lo, round.hi)
	if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
		return finished{}, fmt.Errorf("record outcome: %w", err)
	}
	if f.deleted < int64(len(acked)) {
		// The shards held changed since the round was read (one of them
		// lost, or one more taken): delete, row by row, the events of the
		// shards still held. The range and the "= ANY" deletes each look
		// at relay_shards in a snapshot of their own, so the set may
		// change between them: one deleting and the other not.
		var rowByRow int64
		if err := s.pool.QueryRow(ctx, s.deleteOwnedSQL, acked, owner).Scan(&rowByRow, &f.leftToOthers); err != nil {
			return f, fmt.Errorf("record outcome: %w", err)
		}
		f.deleted += rowByRow
	}
	return f, nil
}

// sortByID returns events in id order. A claim's statements each read in
// id order, so events is a few sorted runs, merged here: sorting them
// moved the 150-byte events about (a tenth of a claim's own CPU beside a
// stuck key).
func sortByID(events []pendingEvent) []pendingEvent {
	var starts []int
	for i := 1; i < len(events); i++ {
		if events[i].id < events[i-1].id {
			if starts = append(starts, i); len(starts) > 3 {
				slices.SortFunc(events, func(a, b pendingEvent) int { return cmp.Compare(a.id, b.id) })
				return events
			}
		}
	}
	if len(starts) == 0 {
		return events
	}
	runs := make([][]pendingEvent, 0, len(starts)+1)
	from := 0
	for _, at := range append(starts, len(events)) {
		runs = append(runs, events[from:at])
		from = at
	}
	out := make([]pendingEvent, 0, len(events))
	for {
		best := -1
		for r := range runs {
			if len(runs[r]) > 0 && (best < 0 || runs[r][0].id < runs[best][0].id) {
				best = r
			}
		}
		if best < 0 {
			return out
		}
		out = append(out, runs[best][0])
		runs[best] = runs[best][1:]
	}
}

// minDeleteRun is the fewest ids a run of consecutive acknowledged ids
// needs to be deleted by a range (deleteRunSQL) rather than among the
// others by "= ANY".
const minDeleteRun = 64

// longestRun returns the longest run of consecutive integers lo to hi in
// ids (sorted, no duplicates), the first of them if several are as long,
// and the ids outside it, in order.
func longestRun(ids []int64) (lo, hi int64, rest []int64) {
	best, bestLen := 0, 0
	for i := 0; i < len(ids); {
		j := i
		for j+1 < len(ids) && ids[j+1] == ids[j]+1 {
			j++
		}
		if j-i+1 > bestLen {
			best, bestLen = i, j-i+1
		}
		i = j + 1
	}
	if bestLen == 0 {
		return 0, -1, nil
	}
	rest = make([]int64, 0, len(ids)-bestLen)
	rest = append(append(rest, ids[:best]...), ids[best+bestLen:]...)
	return ids[best], ids[best+bestLen-1], rest
}

type deadEvent struct {
	id  int64
	err string
}

type failedEvent struct {
	id  int64
	err string
	run refusalRun
	// charge: the failure costs the event an attempt and records its
	// error. Otherwise the row changes only if runReset ends its refusal
	// run (failSQL).
	charge bool
	// inRun: the row was in a run of refusals when read (first_refused_at
	// set). Only the shard's owner starts one, so a row read outside a run
	// is still outside it (a former owner whose lease lapsed mid-round may
	// start one meanwhile; the grace then counts from its refusal).
	inRun bool
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
