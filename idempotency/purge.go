package idempotency

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// PurgeConfig configures a Purger. The zero value is usable.
type PurgeConfig struct {
	// Schema holds onceflow's tables. Defaults to "onceflow".
	Schema string
	// BatchSize is how many records one DELETE removes, so purging never
	// holds many locks or one long transaction. Defaults to 1000.
	BatchSize int
	// Interval is how often Run purges. At least one second (a bare 60 is
	// 60ns, not a minute). Defaults to 1 minute.
	Interval time.Duration
	// Logger receives Run's failures (Warn; a missing privilege at
	// Error). Defaults to slog.Default(): a purger whose purges fail lets
	// the table grow without end.
	Logger *slog.Logger
}

// Purger deletes expired idempotency records: those past their Window
// (Config.Window, FenceConfig.Window), except claims whose lease is still
// held. It is safe for concurrent use, and several Purgers may run at once
// (they skip each other's rows).
type Purger struct {
	db  DB
	sql string
	cfg PurgeConfig
}

// NewPurger returns a Purger; cfg may be nil.
func NewPurger(db DB, cfg *PurgeConfig) (*Purger, error) {
	if db == nil {
		return nil, errors.New("idempotency: db is nil")
	}
	c := PurgeConfig{}
	if cfg != nil {
		c = *cfg
	}
	setDefault(&c.BatchSize, 1000)
	setDefault(&c.Interval, time.Minute)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	switch {
	case c.BatchSize < 0:
		return nil, fmt.Errorf("idempotency: PurgeConfig.BatchSize must be positive, got %d", c.BatchSize)
	case c.Interval < time.Second:
		return nil, fmt.Errorf("idempotency: PurgeConfig.Interval %s is under a second (a unit slip? 60 is 60ns, not seconds)", c.Interval)
	}
	s, err := newStore(c.Schema)
	if err != nil {
		return nil, fmt.Errorf("idempotency: PurgeConfig.Schema: %w", err)
	}
	return &Purger{db: db, sql: s.purgeSQL, cfg: c}, nil
}

// Purge deletes every expired record, BatchSize at a time, and returns how
// many it deleted. It is idempotent.
func (p *Purger) Purge(ctx context.Context) (int64, error) {
	var total int64
	for {
		tag, err := p.db.Exec(ctx, p.sql, p.cfg.BatchSize)
		if err != nil {
			return total, fmt.Errorf("idempotency: purge: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(p.cfg.BatchSize) {
			return total, nil
		}
	}
}

// Run purges every Interval until ctx is done, then returns nil. Failures
// are logged and retried at the next interval: a privilege the role lacks
// (SQLSTATE 42501; README, "Roles and privileges") at Error, since only a
// grant mends it, and the purges go on once it is given.
func (p *Purger) Run(ctx context.Context) error {
	t := time.NewTicker(p.cfg.Interval)
	defer t.Stop()
	for {
		if _, err := p.Purge(ctx); err != nil && ctx.Err() == nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "42501" {
				p.cfg.Logger.Error("idempotency: purge refused: the database role lacks a privilege it needs; expired records stay until it is granted", "error", err)
			} else {
				p.cfg.Logger.Warn("idempotency: purge failed", "error", err)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
