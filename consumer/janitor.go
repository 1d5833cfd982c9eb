package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/migrations"
)

// Execer runs statements: *pgxpool.Pool, *pgx.Conn and pgx.Tx fit.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// JanitorConfig configures a Janitor. The zero value is usable.
type JanitorConfig struct {
	// Schema holds the processed_messages table. Defaults to "onceflow".
	Schema string
	// Window is how long dedup records are kept, counted from processing on
	// the database's clock. It must exceed the longest time a message can
	// be delivered again:
	//   - how long Kafka keeps a record: retention.ms counts from a
	//     segment's newest record, so a quiet topic keeps a record for
	//     retention.ms plus segment.ms (7 + 7 days by Kafka's defaults), and
	//     a group that lost its offsets (idle past offsets.retention.minutes,
	//     7 days by default) or was reset re-reads everything still there;
	//   - plus how long a producer may re-publish an event (the relay's
	//     outbox backlog);
	//   - plus how long a partition's committed offset can stay behind
	//     messages already processed: while one message waits (a dead letter
	//     whose topic is missing, say), the messages after it are processed
	//     but their offsets not committed, and a restart reads them again;
	//   - plus any consumer downtime while the group keeps its offsets.
	// A message redelivered after its record was deleted is processed
	// again. At least one hour (shorter is refused as a unit slip).
	// Defaults to 15 days: Kafka's default retention and segment roll, plus
	// a day.
	//
	// Every consumer's records of the schema are swept, and janitors on one
	// schema keep them for the longest window among them: each records its
	// window in janitor_windows as it sweeps, and deletes only what is
	// older than the longest window of a janitor seen within twice that
	// window. So a service that shares the schema with a shorter window
	// expires nothing early.
	Window time.Duration
	// BatchSize is how many records one DELETE removes, keeping each
	// transaction and its locks short. Defaults to 1000.
	BatchSize int
	// Interval is the time between sweeps in Run. At least one second.
	// Defaults to 1 minute.
	Interval time.Duration
	// Logger receives sweep errors (Warn; a missing privilege at Error).
	// Defaults to slog.Default(): a janitor whose sweeps fail lets the
	// table grow without end.
	Logger *slog.Logger
}

// Janitor deletes dedup records older than the window (the longest of the
// janitors on the schema: see JanitorConfig.Window), for every consumer of
// a schema. It is safe for concurrent use, and several Janitors (one per
// service instance) may run at once.
type Janitor struct {
	db                     Execer
	cfg                    JanitorConfig
	registerSQL, deleteSQL string
}

// NewJanitor returns a Janitor; cfg may be nil.
func NewJanitor(db Execer, cfg *JanitorConfig) (*Janitor, error) {
	if db == nil {
		return nil, errors.New("consumer: janitor: db is nil")
	}
	var c JanitorConfig
	if cfg != nil {
		c = *cfg
	}
	if c.Schema == "" {
		c.Schema = migrations.DefaultSchema
	}
	if c.Window == 0 {
		c.Window = DefaultDedupWindow
	}
	if c.BatchSize == 0 {
		c.BatchSize = 1000
	}
	if c.Interval == 0 {
		c.Interval = time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if err := migrations.ValidateSchema(c.Schema); err != nil {
		return nil, fmt.Errorf("consumer: JanitorConfig.Schema: %w", err)
	}
	switch {
	case c.Window < time.Hour:
		return nil, fmt.Errorf("consumer: JanitorConfig.Window %s is under an hour: records would go before their offsets are committed (a unit slip? 168 is 168ns, not hours)", c.Window)
	case c.BatchSize < 1:
		return nil, errors.New("consumer: JanitorConfig.BatchSize must be at least 1")
	case c.Interval < time.Second:
		return nil, fmt.Errorf("consumer: JanitorConfig.Interval %s is under a second", c.Interval)
	case c.Interval >= c.Window:
		// A janitor is seen on record only when it sweeps: one that sweeps
		// less often than its window would let it lapse between sweeps.
		return nil, fmt.Errorf("consumer: JanitorConfig.Interval %s must be shorter than Window %s", c.Interval, c.Window)
	}
	table := pgx.Identifier{c.Schema, "processed_messages"}.Sanitize()
	windows := pgx.Identifier{c.Schema, "janitor_windows"}.Sanitize()
	// The longest window of a janitor seen within twice that window ($1,
	// this one's, is always among them): twice, so that a janitor that
	// sweeps late is not taken for gone.
	longest := `(SELECT greatest($1::bigint, max(window_seconds)) FROM ` + windows + `
	WHERE seen_at > now() - make_interval(secs => 2 * window_seconds))`
	return &Janitor{db: db, cfg: c,
		// Lapsed windows are forgotten as this one is recorded.
		registerSQL: `WITH lapsed AS (DELETE FROM ` + windows + ` WHERE seen_at < now() - make_interval(secs => 2 * window_seconds) AND window_seconds <> $1)
INSERT INTO ` + windows + ` (window_seconds) VALUES ($1) ON CONFLICT (window_seconds) DO UPDATE SET seen_at = now()`,
		// The inner SELECT walks processed_messages_processed_at_idx; SKIP
		// LOCKED lets concurrent janitors take different rows.
		deleteSQL: `DELETE FROM ` + table + ` WHERE ctid = ANY(ARRAY(
	SELECT ctid FROM ` + table + ` WHERE processed_at < now() - make_interval(secs => ` + longest + `)
	ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED))`}, nil
}

// DefaultDedupWindow is JanitorConfig.Window's default: how long Kafka's
// defaults can keep a record (retention.ms and segment.ms, 7 days each),
// plus a day.
const DefaultDedupWindow = 15 * 24 * time.Hour

// Sweep deletes every record older than the window, one batch per
// statement, and returns how many it deleted. It stops early with ctx's
// error.
func (j *Janitor) Sweep(ctx context.Context) (int64, error) {
	window := int64((j.cfg.Window + time.Second - 1) / time.Second) // rounded up: never shorter
	if _, err := j.db.Exec(ctx, j.registerSQL, window); err != nil {
		return 0, fmt.Errorf("consumer: janitor: record the window: %w", err)
	}
	var total int64
	for {
		tag, err := j.db.Exec(ctx, j.deleteSQL, window, j.cfg.BatchSize)
		if err != nil {
			return total, fmt.Errorf("consumer: janitor: delete expired records: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(j.cfg.BatchSize) {
			return total, nil
		}
	}
}

// Run sweeps at once and then every Interval until ctx is canceled, when it
// returns nil. Sweep errors are logged and retried at the next interval: a
// privilege the role lacks (SQLSTATE 42501; README, "Roles and
// privileges") at Error, since only a grant mends it, and the sweeps go
// on once it is given.
func (j *Janitor) Run(ctx context.Context) error {
	t := time.NewTicker(j.cfg.Interval)
	defer t.Stop()
	for {
		if n, err := j.Sweep(ctx); err != nil && ctx.Err() == nil {
			if isInsufficientPrivilege(err) {
				j.cfg.Logger.Error("consumer: janitor sweep refused: the database role lacks a privilege it needs; expired records stay until it is granted", "error", err)
			} else {
				j.cfg.Logger.Warn("consumer: janitor sweep failed", "error", err)
			}
		} else if n > 0 {
			j.cfg.Logger.Debug("consumer: janitor deleted expired dedup records", "deleted", n)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// isInsufficientPrivilege reports whether err is a permission refusal.
func isInsufficientPrivilege(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42501"
}
