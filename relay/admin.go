package relay

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/migrations"
)

// Querier is satisfied by *pgxpool.Pool, *pgx.Conn and pgx.Tx. In the exec
// and simple_protocol modes results come as text, which pgx reads only
// under bytea_output = 'hex' and an ISO DateStyle (ErrTextResultSettings):
// under other settings, pass a pgx.Tx that first ran
// SELECT set_config('bytea_output', 'hex', true), set_config('DateStyle', 'ISO', true),
// as the onceflow binary does.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// DeadEvent is a row of outbox_dead.
type DeadEvent struct {
	ID        int64
	OutboxID  int64
	EventID   string
	Topic     string
	Key       []byte
	Value     []byte
	Headers   map[string]string
	CreatedAt time.Time
	Error     string
	Attempts  int
	DeadAt    time.Time
}

// ListDead returns up to limit dead events, oldest first.
func ListDead(ctx context.Context, db Querier, schema string, limit int) ([]DeadEvent, error) {
	if err := migrations.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	rows, err := db.Query(ctx, `SELECT `+deadColumns+`
FROM `+pgx.Identifier{schema, "outbox_dead"}.Sanitize()+` d ORDER BY `+writePosition(schema, "d")+`, d.id LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("relay: list dead events: %w", err)
	}
	var out []DeadEvent
	for rows.Next() {
		d, err := scanDead(rows)
		if err != nil {
			rows.Close()
			return nil, fmt.Errorf("relay: list dead events: %w", err)
		}
		out = append(out, d)
	}
	return out, rows.Err()
}

// writePosition is where the outbox_dead row aliased d stands in its key's
// write order: the outbox id its event was first written with. A replayed
// event gets a new outbox id, so a replay records the first one in
// dead_replays (migration 9) by event_id and topic, which the event keeps
// through the outbox and back, whichever relay dead-letters it again (the
// copies of an event fanned out to several topics each keep their own).
// Dead events are listed and replayed by it, then by their own id.
func writePosition(schema, d string) string {
	return `coalesce((SELECT rp.first_outbox_id FROM ` + pgx.Identifier{schema, "dead_replays"}.Sanitize() +
		` rp WHERE rp.event_id = ` + d + `.event_id AND rp.topic = ` + d + `.topic), ` + d + `.outbox_id)`
}

// replayableTopic is true for a topic name Kafka accepts, as the
// outbox_topic domain says (migration 11's form: a bounded repetition costs
// PostgreSQL's regex engine tens of µs a row); a dead event on another name
// (one migration 8 dead-lettered) cannot go back into the outbox.
const replayableTopic = `(octet_length(topic) <= 249 AND topic ~ '^[A-Za-z0-9._-]+$' AND topic NOT IN ('.', '..'))`

const deadColumns = `id, outbox_id, event_id::text, topic, key, value, headers, created_at, error, attempts, dead_at`

func scanDead(rows pgx.Rows) (DeadEvent, error) {
	var d DeadEvent
	err := rows.Scan(&d.ID, &d.OutboxID, &d.EventID, &d.Topic, &d.Key, &d.Value, &d.Headers, &d.CreatedAt, &d.Error, &d.Attempts, &d.DeadAt)
	return d, err
}

// ReplayDead moves dead events back into the outbox in one statement,
// keeping their event_id (so consumers still deduplicate them) and their
// write order among themselves, also across replays. ids selects
// outbox_dead ids; nil means all, and an empty non-nil slice is an error.
// When an id is not a dead event, ReplayDead moves nothing and returns a
// *DeadNotFoundError naming the missing ids. When a replayed event's key
// has an earlier dead event left out of ids, the replay would publish the
// key's events out of order (G3): ReplayDead moves nothing and returns a
// *DeadOutOfOrderError naming those earlier events, unless
// ReplayOutOfOrder is given. It returns how many it moved. A replayed event
// goes to the back of its key's queue: events of the same key written
// after it was dead-lettered have already been published.
func ReplayDead(ctx context.Context, db Querier, schema string, ids []int64, opts ...ReplayOption) (int, error) {
	if err := migrations.ValidateSchema(schema); err != nil {
		return 0, fmt.Errorf("relay: %w", err)
	}
	if ids != nil && len(ids) == 0 {
		return 0, fmt.Errorf("relay: replay dead events: no ids given (nil means all)")
	}
	var cfg replayConfig
	for _, o := range opts {
		o(&cfg)
	}
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	dead := pgx.Identifier{schema, "outbox_dead"}.Sanitize()
	replays := pgx.Identifier{schema, "dead_replays"}.Sanitize()
	// held: the earlier dead events, left out of ids, of the keys being
	// replayed. Keyless events have no order to keep. unfit: the events
	// asked for whose topic name Kafka refuses.
	held := `SELECT h.id FROM ` + dead + ` h WHERE $1::bigint[] IS NOT NULL AND NOT $2::boolean
        AND h.key IS NOT NULL AND h.id <> ALL($1::bigint[])
        AND EXISTS (SELECT 1 FROM ` + dead + ` r WHERE r.id = ANY($1::bigint[]) AND r.key = h.key
            AND (` + writePosition(schema, "r") + `, r.id) > (` + writePosition(schema, "h") + `, h.id))`
	unfit := `SELECT u.id FROM ` + dead + ` u WHERE ($1::bigint[] IS NULL OR u.id = ANY($1::bigint[])) AND NOT ` + replayableTopic
	rows, err := db.Query(ctx, `WITH held AS (`+held+`),
unfit AS (`+unfit+`),
`+strings.TrimPrefix(deadTake(schema, "id, outbox_id, event_id, topic, key, value, headers, created_at, "+writePosition(schema, "d")+" AS position",
		"NOT EXISTS (SELECT 1 FROM held) AND NOT EXISTS (SELECT 1 FROM unfit)"), "WITH ")+`,
ins AS (
    INSERT INTO `+outbox+` (event_id, topic, key, value, headers, created_at)
    SELECT event_id, topic, key, value, headers, created_at FROM taken ORDER BY position, id
    RETURNING 1),
first AS (
    INSERT INTO `+replays+` (event_id, topic, first_outbox_id)
    SELECT DISTINCT ON (event_id, topic) event_id, topic, position FROM taken ORDER BY event_id, topic, position
    ON CONFLICT (event_id, topic) DO NOTHING
    RETURNING 1)
SELECT 'taken', id FROM taken
UNION ALL SELECT 'held', id FROM held
UNION ALL SELECT 'unfit', id FROM unfit`, ids, cfg.outOfOrder)
	if err != nil {
		return 0, fmt.Errorf("relay: replay dead events: %w", err)
	}
	var moved, earlier, refused []int64
	var kind string
	var id int64
	if _, err := pgx.ForEachRow(rows, []any{&kind, &id}, func() error {
		switch kind {
		case "taken":
			moved = append(moved, id)
		case "held":
			earlier = append(earlier, id)
		default:
			refused = append(refused, id)
		}
		return nil
	}); err != nil {
		return 0, fmt.Errorf("relay: replay dead events: %w", err)
	}
	if err := notFound(ctx, db, schema, "replayed", ids, moved); err != nil {
		return len(moved), err
	}
	if len(refused) > 0 {
		slices.Sort(refused)
		return 0, &DeadUnreplayableError{IDs: refused}
	}
	if len(earlier) > 0 {
		slices.Sort(earlier)
		return 0, &DeadOutOfOrderError{IDs: earlier}
	}
	return len(moved), nil
}

// ReplayOption changes how ReplayDead replays.
type ReplayOption func(*replayConfig)

type replayConfig struct{ outOfOrder bool }

// ReplayOutOfOrder lets ReplayDead replay a key's dead events while earlier
// dead events of the same key stay dead: they will be published after
// them, if ever.
func ReplayOutOfOrder() ReplayOption { return func(c *replayConfig) { c.outOfOrder = true } }

// DeadOutOfOrderError names the dead events that a replay left out and
// that come before, in their key's write order, an event it would have
// replayed. Nothing was replayed: replay them along, or say the order does
// not matter (ReplayOutOfOrder).
type DeadOutOfOrderError struct {
	IDs []int64
}

// DeadUnreplayableError names the dead events a replay asked for whose
// topic name Kafka refuses (events migration 8 dead-lettered): they cannot
// go back into the outbox. Nothing was replayed: discard them, or leave
// them out.
type DeadUnreplayableError struct {
	IDs []int64
}

func (e *DeadUnreplayableError) Error() string {
	return fmt.Sprintf("relay: nothing replayed: dead events %s have topic names Kafka refuses and cannot be replayed; discard them or leave them out", joinIDs(e.IDs))
}

func joinIDs(ids []int64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(s, ", ")
}

func (e *DeadOutOfOrderError) Error() string {
	return fmt.Sprintf("relay: nothing replayed: dead events %s come first in their keys' order and would be published after the ones given; replay them too, or replay out of order on purpose", joinIDs(e.IDs))
}

// DiscardDead deletes the given dead events for good and returns them, so
// the caller can keep a copy. ids must not be empty. When an id is not a
// dead event, DiscardDead deletes nothing and returns a *DeadNotFoundError.
func DiscardDead(ctx context.Context, db Querier, schema string, ids []int64) ([]DeadEvent, error) {
	if err := migrations.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	if len(ids) == 0 {
		return nil, fmt.Errorf("relay: discard dead events: no ids given")
	}
	rows, err := db.Query(ctx, deadTake(schema, deadColumns+", "+writePosition(schema, "d")+" AS position", "true")+`,
forget AS (DELETE FROM `+pgx.Identifier{schema, "dead_replays"}.Sanitize()+` WHERE (event_id, topic) IN (SELECT event_id::uuid, topic FROM taken))
SELECT `+deadColumns+` FROM taken ORDER BY position, id`, ids)
	if err != nil {
		return nil, fmt.Errorf("relay: discard dead events: %w", err)
	}
	var out []DeadEvent
	var moved []int64
	for rows.Next() {
		d, err := scanDead(rows)
		if err != nil {
			rows.Close()
			return nil, fmt.Errorf("relay: discard dead events: %w", err)
		}
		out = append(out, d)
		moved = append(moved, d.ID)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("relay: discard dead events: %w", err)
	}
	return out, notFound(ctx, db, schema, "discarded", ids, moved)
}

// deadTake is the start of a statement that deletes the outbox_dead rows
// whose ids are in $1 (all when $1 is NULL) into the CTE "taken", returning
// cols, but only when every id in $1 is there and the SQL condition when
// holds.
func deadTake(schema, cols, when string) string {
	dead := pgx.Identifier{schema, "outbox_dead"}.Sanitize()
	return `WITH missing AS (
    SELECT count(*) AS n FROM unnest($1::bigint[]) AS w(id)
    WHERE NOT EXISTS (SELECT 1 FROM ` + dead + ` d WHERE d.id = w.id)),
taken AS (
    DELETE FROM ` + dead + ` d WHERE ($1::bigint[] IS NULL OR id = ANY($1::bigint[])) AND (SELECT n FROM missing) = 0 AND ` + when + `
    RETURNING ` + cols + `)`
}

// notFound returns a *DeadNotFoundError for the ids asked for that were
// neither taken nor are still there (held back because another id was
// missing).
func notFound(ctx context.Context, db Querier, schema, did string, asked, taken []int64) error {
	if asked == nil {
		return nil
	}
	left := map[int64]bool{}
	for _, id := range asked {
		left[id] = true
	}
	for _, id := range taken {
		delete(left, id)
	}
	if len(left) == 0 {
		return nil
	}
	rows, err := db.Query(ctx, `SELECT id FROM `+pgx.Identifier{schema, "outbox_dead"}.Sanitize()+` WHERE id = ANY($1)`, asked)
	if err != nil {
		return fmt.Errorf("relay: look up dead events: %w", err)
	}
	present, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return fmt.Errorf("relay: look up dead events: %w", err)
	}
	for _, id := range present {
		delete(left, id)
	}
	missing := make([]int64, 0, len(left))
	for id := range left {
		missing = append(missing, id)
	}
	if len(missing) == 0 {
		return nil
	}
	slices.Sort(missing)
	return &DeadNotFoundError{IDs: missing, Done: len(taken), did: did}
}

// DeadNotFoundError names the ids ReplayDead or DiscardDead were given that
// are not dead events. Done says how many events were handled anyway: 0,
// unless another process took some of the ids at the same moment.
type DeadNotFoundError struct {
	IDs  []int64
	Done int
	did  string
}

func (e *DeadNotFoundError) Error() string {
	return fmt.Sprintf("relay: no dead events with ids %s (%s %d)", joinIDs(e.IDs), e.did, e.Done)
}

// Status is what operators check: backlog, age, dead letters, relays.
type Status struct {
	Backlog       int64
	OldestPending *time.Time
	MaxAttempts   int
	DeadLetters   int64
	Relays        []InstanceStatus
	// UnownedShards counts shards no live relay holds.
	UnownedShards int
	// ReadAt is the database's clock (now()) at the reading: measure
	// OldestPending and the relays' times against it, not against this
	// host's clock, which may be skewed from the database's.
	ReadAt time.Time
}

// InstanceStatus is one relay process.
type InstanceStatus struct {
	ID          string
	Hostname    string
	PID         int
	StartedAt   time.Time
	HeartbeatAt time.Time
	Live        bool
	Shards      []int16
}

// ShardBacklog is one shard's pending events.
type ShardBacklog struct {
	Shard         int16
	Pending       int64
	OldestPending time.Time
}

// ReadStatus reads the relay's state from the database.
func ReadStatus(ctx context.Context, db Querier, schema string) (*Status, error) {
	if err := migrations.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	id := func(t string) string { return pgx.Identifier{schema, t}.Sanitize() }
	st := &Status{}
	err := db.QueryRow(ctx, `SELECT
    (SELECT count(*) FROM `+id("outbox")+`),
    (SELECT min(created_at) FROM `+id("outbox")+`),
    (SELECT coalesce(max(attempts), 0) FROM `+id("outbox")+`),
    (SELECT count(*) FROM `+id("outbox_dead")+`),
    (SELECT `+unownedShards(id("relay_shards"))+`),
    now()`).
		Scan(&st.Backlog, &st.OldestPending, &st.MaxAttempts, &st.DeadLetters, &st.UnownedShards, &st.ReadAt)
	if err != nil {
		return nil, fmt.Errorf("relay: read status: %w", err)
	}
	rows, err := db.Query(ctx, `SELECT i.id, i.hostname, i.pid, i.started_at, i.heartbeat_at, i.lease_until > now(),
    coalesce(array_agg(s.shard ORDER BY s.shard) FILTER (WHERE s.shard IS NOT NULL), '{}')
FROM `+id("relay_instances")+` i
LEFT JOIN `+id("relay_shards")+` s ON s.owner = i.id AND s.lease_until > now()
GROUP BY i.id ORDER BY i.started_at`)
	if err != nil {
		return nil, fmt.Errorf("relay: read relays: %w", err)
	}
	for rows.Next() {
		var in InstanceStatus
		if err := rows.Scan(&in.ID, &in.Hostname, &in.PID, &in.StartedAt, &in.HeartbeatAt, &in.Live, &in.Shards); err != nil {
			rows.Close()
			return nil, fmt.Errorf("relay: read relays: %w", err)
		}
		st.Relays = append(st.Relays, in)
	}
	return st, rows.Err()
}

// ReadShardBacklog returns the pending count and oldest event per shard
// that has any. It scans the pending rows: cheap while the relay keeps up,
// a second or so at a backlog of millions.
func ReadShardBacklog(ctx context.Context, db Querier, schema string) ([]ShardBacklog, error) {
	if err := migrations.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	rows, err := db.Query(ctx, `SELECT shard, count(*), min(created_at) FROM `+
		pgx.Identifier{schema, "outbox"}.Sanitize()+` GROUP BY shard ORDER BY shard`)
	if err != nil {
		return nil, fmt.Errorf("relay: read shard backlog: %w", err)
	}
	var out []ShardBacklog
	for rows.Next() {
		var b ShardBacklog
		if err := rows.Scan(&b.Shard, &b.Pending, &b.OldestPending); err != nil {
			rows.Close()
			return nil, err
		}
		out = append(out, b)
	}
	return out, rows.Err()
}
