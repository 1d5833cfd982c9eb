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
	// Window is how long dedup records are kept. It must exceed the longest
	// time a message can be delivered again: the topic's retention (a
	// consumer group reset to the earliest offset re-reads everything still
	// in the topic), plus how long a producer may re-publish an event (the
	// relay's outbox backlog), plus any consumer downtime. A message
	// redelivered after its record was deleted is processed again.
	// Defaults to 7 days.
	Window time.Duration
	// BatchSize is how many records one DELETE removes, keeping each
	// transaction and its locks short. Defaults to 1000.
	BatchSize int
	// Interval is the time between sweeps in Run. Defaults to 1 minute.
	Interval time.Duration
	// Logger receives sweep errors (Warn). Defaults to discarding.
	Logger *slog.Logger
}

// Janitor deletes dedup records older than the window, for every consumer
// of a schema. It is safe for concurrent use, and several Janitors (one per
// service instance) may run at once.
type Janitor struct {
	db        Execer
	cfg       JanitorConfig
	deleteSQL string
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
		c.Window = 7 * 24 * time.Hour
	}
	if c.BatchSize == 0 {
		c.BatchSize = 1000
	}
	if c.Interval == 0 {
		c.Interval = time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if err := migrations.ValidateSchema(c.Schema); err != nil {
		return nil, fmt.Errorf("consumer: JanitorConfig.Schema: %w", err)
	}
	switch {
	case c.Window < 0:
		return nil, errors.New("consumer: JanitorConfig.Window must not be negative")
	case c.BatchSize < 1:
		return nil, errors.New("consumer: JanitorConfig.BatchSize must be at least 1")
	case c.Interval < 0:
		return nil, errors.New("consumer: JanitorConfig.Interval must not be negative")
	}
	table := pgx.Identifier{c.Schema, "processed_messages"}.Sanitize()
	// The inner SELECT walks processed_messages_processed_at_idx; SKIP
	// LOCKED lets concurrent janitors take different rows.
	return &Janitor{db: db, cfg: c, deleteSQL: `DELETE FROM ` + table + ` WHERE ctid = ANY(ARRAY(
	SELECT ctid FROM ` + table + ` WHERE processed_at < now() - $1::interval
	ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED))`}, nil
}

// Sweep deletes every record older than the window, one batch per
// statement, and returns how many it deleted. It stops early with ctx's
// error.
func (j *Janitor) Sweep(ctx context.Context) (int64, error) {
	var total int64
	for {
		tag, err := j.db.Exec(ctx, j.deleteSQL, j.cfg.Window, j.cfg.BatchSize)
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
// returns nil. Sweep errors are logged and retried at the next interval.
func (j *Janitor) Run(ctx context.Context) error {
	t := time.NewTicker(j.cfg.Interval)
	defer t.Stop()
	for {
		if n, err := j.Sweep(ctx); err != nil && ctx.Err() == nil {
			j.cfg.Logger.Warn("consumer: janitor sweep failed", "error", err)
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
