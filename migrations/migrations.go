package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

//go:embed *.sql
var files embed.FS

// FS holds the numbered SQL files (0001_init.up.sql, 0001_init.down.sql, …)
// for users who apply migrations with their own tool. Each file expects
// search_path to be set to the target schema.
var FS fs.FS = files

// DefaultSchema is the schema onceflow's tables live in unless configured.
const DefaultSchema = "onceflow"

// Migration is one numbered step.
type Migration struct {
	Version int
	Name    string
	Up      string
	Down    string
}

// Status is a migration and whether it is applied in a schema.
type Status struct {
	Migration
	AppliedAt *time.Time
}

// Beginner is satisfied by *pgxpool.Pool and *pgx.Conn.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// All returns every migration in version order.
func All() ([]Migration, error) {
	entries, err := fs.ReadDir(files, ".")
	if err != nil {
		return nil, err
	}
	byVersion := map[int]*Migration{}
	for _, e := range entries {
		name := e.Name()
		var direction string
		switch {
		case strings.HasSuffix(name, ".up.sql"):
			direction = "up"
		case strings.HasSuffix(name, ".down.sql"):
			direction = "down"
		default:
			continue
		}
		prefix, rest, ok := strings.Cut(name, "_")
		version, err := strconv.Atoi(prefix)
		if !ok || err != nil || version <= 0 {
			return nil, fmt.Errorf("migrations: bad file name %q: want NNNN_name.up.sql", name)
		}
		body, err := fs.ReadFile(files, path.Clean(name))
		if err != nil {
			return nil, err
		}
		m := byVersion[version]
		if m == nil {
			m = &Migration{Version: version, Name: strings.TrimSuffix(strings.TrimSuffix(rest, ".up.sql"), ".down.sql")}
			byVersion[version] = m
		}
		if direction == "up" {
			m.Up = string(body)
		} else {
			m.Down = string(body)
		}
	}
	out := make([]Migration, 0, len(byVersion))
	for _, m := range byVersion {
		if m.Up == "" || m.Down == "" {
			return nil, fmt.Errorf("migrations: version %d lacks its up or down file", m.Version)
		}
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Up applies every pending migration to schema (created if missing) in one
// transaction and returns the versions it applied. It is idempotent and safe
// to run from several processes at once: they serialize on an advisory lock,
// and the later ones find nothing to do.
func Up(ctx context.Context, db Beginner, schema string) ([]int, error) {
	all, err := All()
	if err != nil {
		return nil, err
	}
	var applied []int
	err = inLockedTx(ctx, db, schema, func(tx pgx.Tx, done map[int]time.Time) error {
		for _, m := range all {
			if _, ok := done[m.Version]; ok {
				continue
			}
			if _, err := tx.Exec(ctx, m.Up); err != nil {
				return fmt.Errorf("migrations: apply %04d_%s: %w", m.Version, m.Name, err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO schema_migrations (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
				return fmt.Errorf("migrations: record %04d: %w", m.Version, err)
			}
			applied = append(applied, m.Version)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return applied, nil
}

// Down reverts the newest steps applied migrations (at least one) and returns
// the versions it reverted, newest first.
func Down(ctx context.Context, db Beginner, schema string, steps int) ([]int, error) {
	if steps < 1 {
		return nil, fmt.Errorf("migrations: steps must be at least 1, got %d", steps)
	}
	all, err := All()
	if err != nil {
		return nil, err
	}
	var reverted []int
	err = inLockedTx(ctx, db, schema, func(tx pgx.Tx, done map[int]time.Time) error {
		for i := len(all) - 1; i >= 0 && len(reverted) < steps; i-- {
			m := all[i]
			if _, ok := done[m.Version]; !ok {
				continue
			}
			if _, err := tx.Exec(ctx, m.Down); err != nil {
				return fmt.Errorf("migrations: revert %04d_%s: %w", m.Version, m.Name, err)
			}
			if _, err := tx.Exec(ctx, `DELETE FROM schema_migrations WHERE version = $1`, m.Version); err != nil {
				return fmt.Errorf("migrations: unrecord %04d: %w", m.Version, err)
			}
			reverted = append(reverted, m.Version)
		}
		return nil
	})
	return reverted, err
}

// List reports every known migration and when it was applied to schema.
// It only reads: a schema that does not exist lists every migration as
// pending.
func List(ctx context.Context, db Beginner, schema string) ([]Status, error) {
	if err := ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	all, err := All()
	if err != nil {
		return nil, err
	}
	done := map[int]time.Time{}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		table := pgx.Identifier{schema, "schema_migrations"}.Sanitize()
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil || !exists {
			return err
		}
		rows, err := tx.Query(ctx, `SELECT version, applied_at FROM `+table)
		if err != nil {
			return err
		}
		var v int
		var at time.Time
		_, err = pgx.ForEachRow(rows, []any{&v, &at}, func() error { done[v] = at; return nil })
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("migrations: read versions: %w", err)
	}
	out := make([]Status, 0, len(all))
	for _, m := range all {
		s := Status{Migration: m}
		if at, ok := done[m.Version]; ok {
			s.AppliedAt = &at
		}
		out = append(out, s)
	}
	return out, nil
}

// ValidateSchema rejects schema names that cannot be a PostgreSQL identifier.
func ValidateSchema(schema string) error {
	switch {
	case schema == "":
		return errors.New("schema name is empty")
	case len(schema) > 63:
		return fmt.Errorf("schema name %q is longer than 63 bytes", schema)
	case strings.ContainsRune(schema, 0):
		return fmt.Errorf("schema name %q contains a NUL byte", schema)
	}
	return nil
}

// inLockedTx runs fn in a transaction that holds the schema's migration lock,
// has search_path set to the schema, and sees the applied versions.
func inLockedTx(ctx context.Context, db Beginner, schema string, fn func(pgx.Tx, map[int]time.Time) error) error {
	if err := ValidateSchema(schema); err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('onceflow.migrate.' || $1, 0))`, schema); err != nil {
			return fmt.Errorf("migrations: take lock: %w", err)
		}
		ident := pgx.Identifier{schema}.Sanitize()
		if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+ident); err != nil {
			return fmt.Errorf("migrations: create schema %s: %w", ident, err)
		}
		// public stays on the path for gen_random_uuid and extensions.
		if _, err := tx.Exec(ctx, `SELECT set_config('search_path', $1, true)`, ident+", public"); err != nil {
			return fmt.Errorf("migrations: set search_path: %w", err)
		}
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
			version    integer PRIMARY KEY,
			name       text NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
			return fmt.Errorf("migrations: create version table: %w", err)
		}
		rows, err := tx.Query(ctx, `SELECT version, applied_at FROM schema_migrations`)
		if err != nil {
			return fmt.Errorf("migrations: read versions: %w", err)
		}
		done := map[int]time.Time{}
		var v int
		var at time.Time
		if _, err := pgx.ForEachRow(rows, []any{&v, &at}, func() error { done[v] = at; return nil }); err != nil {
			return fmt.Errorf("migrations: read versions: %w", err)
		}
		return fn(tx, done)
	})
}
