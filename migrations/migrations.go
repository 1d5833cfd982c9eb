package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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
// No wait for a table's lock lasts longer than DefaultLockTimeout (a step
// that waits for a table's ACCESS EXCLUSIVE lock behind an open
// transaction holds off every producer's insert meanwhile): past it, Up
// fails, applying nothing, naming the sessions that hold the schema's
// tables. UpWith sets another bound.
// A schema that holds onceflow's tables but no version table (applied
// from the files by another tool) is refused, changing nothing, with the
// *MissingError Check returns, whose message gives the SQL that records
// the versions applied.
func Up(ctx context.Context, db Beginner, schema string) ([]int, error) {
	return UpWith(ctx, db, schema, nil)
}

// UpConfig tunes UpWith.
type UpConfig struct {
	// LockTimeout bounds each wait for a lock while the pending steps run
	// (PostgreSQL's lock_timeout, set for the migration's transaction
	// only, in place of one the connection sets): while a step waits for a
	// table, the transactions that would use it (producers) queue behind
	// its request. Past it, Up fails whole, applying nothing, naming the
	// sessions that hold the schema's tables. It does not bound the wait
	// for another process migrating the same schema. Defaults to
	// DefaultLockTimeout (5 s).
	LockTimeout time.Duration
}

// UpWith is Up with a configuration; cfg may be nil.
func UpWith(ctx context.Context, db Beginner, schema string, cfg *UpConfig) ([]int, error) {
	var c UpConfig
	if cfg != nil {
		c = *cfg
	}
	if c.LockTimeout == 0 {
		c.LockTimeout = DefaultLockTimeout
	}
	if err := checkLockTimeout("UpConfig.LockTimeout", c.LockTimeout); err != nil {
		return nil, err
	}
	all, err := All()
	if err != nil {
		return nil, err
	}
	var applied []int
	err = inLockedTx(ctx, db, schema, true, func(tx pgx.Tx, done map[int]time.Time) error {
		if err := setLockTimeout(ctx, tx, c.LockTimeout); err != nil {
			return err
		}
		for _, m := range all {
			if _, ok := done[m.Version]; ok {
				continue
			}
			if err := execWaiting(ctx, tx, m.Up, schema, "", c.LockTimeout, upHint); err != nil {
				return fmt.Errorf("migrations: apply %04d_%s (nothing applied: the pending steps are one transaction): %w", m.Version, m.Name, err)
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

// checkLockTimeout refuses a lock timeout PostgreSQL would not take
// (field names it).
func checkLockTimeout(field string, d time.Duration) error {
	if d < time.Millisecond || d > MaxLockTimeout {
		return fmt.Errorf("migrations: %s must be from 1ms to %s (PostgreSQL's limit), got %s", field, MaxLockTimeout, d)
	}
	return nil
}

// setLockTimeout bounds, for the rest of tx, every wait for a lock. It
// comes after the advisory lock: processes migrating the same schema
// wait for each other without bound.
func setLockTimeout(ctx context.Context, tx pgx.Tx, d time.Duration) error {
	if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, fmt.Sprintf("%dms", d.Milliseconds())); err != nil {
		return fmt.Errorf("migrations: set lock_timeout: %w", err)
	}
	return nil
}

// Down reverts the newest steps applied migrations (at least one) and returns
// the versions it reverted, newest first. It refuses, reverting nothing, with
// a *DataLossError when a table it would drop holds rows (pending events,
// dead letters, dedup records, idempotency keys, the write order of dead
// events replayed, janitors' live windows); DownForce drops them.
// It counts those rows first without a lock, so that a revert it refuses
// holds off no producer; finding none, it locks the tables and counts
// again, so it waits for the transactions writing to them and counts what
// they commit. No wait for a lock lasts longer than DefaultLockTimeout
// (producers' inserts queue behind a lock request): past it, Down fails,
// reverting nothing, naming the sessions that hold the table. DownWith
// sets another bound.
// A schema that was never migrated is left alone: Down creates nothing.
func Down(ctx context.Context, db Beginner, schema string, steps int) ([]int, error) {
	return DownWith(ctx, db, schema, steps, nil)
}

// DownForce is Down that drops tables whatever rows they hold.
func DownForce(ctx context.Context, db Beginner, schema string, steps int) ([]int, error) {
	return DownWith(ctx, db, schema, steps, &DownConfig{Force: true})
}

// DefaultLockTimeout bounds Up's and Down's wait for each lock they take.
const DefaultLockTimeout = 5 * time.Second

// MaxLockTimeout is the longest lock_timeout PostgreSQL takes (INT_MAX
// milliseconds, about 24.8 days).
const MaxLockTimeout = (1<<31 - 1) * time.Millisecond

// DownConfig tunes DownWith.
type DownConfig struct {
	// Force drops tables whatever rows they hold (DownForce). Defaults to
	// false: refuse with a *DataLossError.
	Force bool
	// LockTimeout bounds each wait for a lock during the revert
	// (PostgreSQL's lock_timeout): while Down waits for a table, the
	// transactions writing to it queue behind its request. Past it, the
	// revert fails whole, naming the sessions that hold the table.
	// Defaults to DefaultLockTimeout (5 s).
	LockTimeout time.Duration
}

// DownWith is Down with a configuration; cfg may be nil.
func DownWith(ctx context.Context, db Beginner, schema string, steps int, cfg *DownConfig) ([]int, error) {
	var c DownConfig
	if cfg != nil {
		c = *cfg
	}
	if c.LockTimeout == 0 {
		c.LockTimeout = DefaultLockTimeout
	}
	if err := checkLockTimeout("DownConfig.LockTimeout", c.LockTimeout); err != nil {
		return nil, err
	}
	return down(ctx, db, schema, steps, c)
}

// dataTables hold what users would lose: Down refuses to drop them while
// they hold rows (heldRows). The relay's own tables (relay_shards always
// has its 256 rows) are not among them.
var dataTables = []string{"outbox", "outbox_dead", "processed_messages", "idempotency_keys", "dead_replays", "janitor_windows"}

// heldRows is, for a data table whose rows do not all count, which do (a
// condition on its row r, in the schema of the search path): the rest is
// dropped without asking.
//   - dead_replays: a replayed event's place in its key's write order,
//     while the event is still pending or dead. Dropped, a key's dead
//     events list and replay out of order, and replaying the later one
//     alone is no longer refused (G3).
//   - janitor_windows: a window whose janitor swept within twice it.
//     Dropped, a janitor with a shorter window deletes another service's
//     dedup records before that service's janitor records its own again
//     (G5).
var heldRows = map[string]string{
	"dead_replays": `EXISTS (SELECT FROM outbox o WHERE o.event_id = r.event_id AND o.topic = r.topic)
    OR EXISTS (SELECT FROM outbox_dead d WHERE d.event_id = r.event_id AND d.topic = r.topic)`,
	"janitor_windows": `r.seen_at > now() - 2 * r.window_seconds * interval '1 second'`,
}

// heldRowsQuery selects up to limit rows of table that count (heldRows),
// table unqualified: run it with the schema on the search path.
func heldRowsQuery(table string, limit int) string {
	q := `SELECT 1 FROM ` + pgx.Identifier{table}.Sanitize() + ` r`
	if cond, ok := heldRows[table]; ok {
		q += ` WHERE ` + cond
	}
	return q + fmt.Sprintf(` LIMIT %d`, limit)
}

// DataLossError is Down's refusal to drop tables that hold rows.
type DataLossError struct {
	Schema string
	// Tables maps each table that would be dropped to its row count,
	// counted up to 1001 (1001 means "more than 1000").
	Tables map[string]int64
}

func (e *DataLossError) Error() string {
	names := make([]string, 0, len(e.Tables))
	for t := range e.Tables {
		names = append(names, t)
	}
	sort.Strings(names)
	parts := make([]string, len(names))
	for i, t := range names {
		n := fmt.Sprint(e.Tables[t])
		if e.Tables[t] > 1000 {
			n = "more than 1000"
		}
		parts[i] = fmt.Sprintf("%s (%s rows)", t, n)
	}
	// The tables whose rows cannot be drained say what ends them.
	how := "drain or export them first"
	if _, ok := e.Tables["dead_replays"]; ok {
		how += "; dead_replays rows last while their events are pending or dead (replay or discard those)"
	}
	if _, ok := e.Tables["janitor_windows"]; ok {
		how += "; janitor_windows rows lapse twice their window after the consumers' janitors stop"
	}
	return fmt.Sprintf("migrations: refusing to revert: it would drop %s in schema %s; "+
		"%s, or force it (onceflow migrate down --force, migrations.DownForce)",
		strings.Join(parts, ", "), pgx.Identifier{e.Schema}.Sanitize(), how)
}

func down(ctx context.Context, db Beginner, schema string, stepCount int, cfg DownConfig) ([]int, error) {
	if stepCount < 1 {
		return nil, fmt.Errorf("migrations: steps must be at least 1, got %d", stepCount)
	}
	all, err := All()
	if err != nil {
		return nil, err
	}
	var reverted []int
	err = inLockedTx(ctx, db, schema, false, func(tx pgx.Tx, done map[int]time.Time) error {
		// A newer onceflow's steps above ours: reverting ours beneath them
		// would leave a schema that neither binary matches.
		if unknown := unknownVersions(all, done); len(unknown) > 0 {
			return fmt.Errorf("migrations: schema %s holds migration %v, which this onceflow does not know (a newer one applied it): revert with that version's onceflow",
				pgx.Identifier{schema}.Sanitize(), unknown)
		}
		// The steps to revert, newest first.
		var steps []Migration
		for i := len(all) - 1; i >= 0 && len(steps) < stepCount; i-- {
			if _, ok := done[all[i].Version]; ok {
				steps = append(steps, all[i])
			}
		}
		// Every lock the revert waits for holds off, while it waits, the
		// transactions that would take the table after it: producers.
		if err := setLockTimeout(ctx, tx, cfg.LockTimeout); err != nil {
			return err
		}
		if !cfg.Force {
			if err := refuseDataLoss(ctx, tx, schema, steps, cfg.LockTimeout); err != nil {
				return err
			}
		}
		for _, m := range steps {
			if err := execWaiting(ctx, tx, m.Down, schema, "", cfg.LockTimeout, downHint); err != nil {
				return fmt.Errorf("migrations: revert %04d_%s: %w", m.Version, m.Name, err)
			}
			if _, err := tx.Exec(ctx, `DELETE FROM schema_migrations WHERE version = $1`, m.Version); err != nil {
				return fmt.Errorf("migrations: unrecord %04d: %w", m.Version, err)
			}
			reverted = append(reverted, m.Version)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return reverted, nil
}

// refuseDataLoss returns a *DataLossError when a data table the steps drop
// holds rows. It counts first without a lock: a revert it refuses must not
// queue for the table's ACCESS EXCLUSIVE lock behind an open transaction
// that read it (a psql session), holding off every producer meanwhile.
// Finding none, it locks the tables (waiting at most lockTimeout) and
// counts again, so that an event whose transaction commits meanwhile is
// counted, not dropped with its table. Only the tables the steps drop are
// locked: a step that drops none waits for no writer and holds none off.
func refuseDataLoss(ctx context.Context, tx pgx.Tx, schema string, steps []Migration, lockTimeout time.Duration) error {
	dropped := droppedTables(steps)
	var tables []string
	for _, table := range dataTables {
		if !dropped[table] {
			continue
		}
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, pgx.Identifier{schema, table}.Sanitize()).Scan(&exists); err != nil {
			return fmt.Errorf("migrations: look up %s: %w", table, err)
		}
		if exists {
			tables = append(tables, table)
		}
	}
	count := func() error {
		held := map[string]int64{}
		for _, table := range tables {
			var n int64
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM (`+heldRowsQuery(table, 1001)+`) n`).Scan(&n); err != nil {
				return fmt.Errorf("migrations: count rows of %s: %w", table, err)
			}
			if n > 0 {
				held[table] = n
			}
		}
		if len(held) > 0 {
			return &DataLossError{Schema: schema, Tables: held}
		}
		return nil
	}
	if err := count(); err != nil {
		return err
	}
	for _, table := range tables {
		lock := `LOCK TABLE ` + pgx.Identifier{schema, table}.Sanitize() + ` IN ACCESS EXCLUSIVE MODE`
		if err := execWaiting(ctx, tx, lock, schema, table, lockTimeout, downHint); err != nil {
			return fmt.Errorf("migrations: lock %s: %w", table, err)
		}
	}
	return count()
}

// How to give Up's and Down's lock waits longer.
const (
	upHint   = "onceflow migrate up --lock-timeout, UpConfig.LockTimeout"
	downHint = "onceflow migrate down --lock-timeout, DownConfig.LockTimeout"
)

// execWaiting runs sql, which may wait for locks on schema's tables (on
// table alone when not empty), in a savepoint of tx, so that when it gives
// up waiting its error can name the sessions holding them (lockWaitError);
// longer says how to wait longer.
func execWaiting(ctx context.Context, tx pgx.Tx, sql, schema, table string, lockTimeout time.Duration, longer string) error {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return err
	}
	// The server's clock, for lockWaitError: a transaction that began
	// after sql did was not what it waited for.
	var began time.Time
	if err := sp.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&began); err != nil {
		return err
	}
	if _, err := sp.Exec(ctx, sql); err != nil {
		return lockWaitError(ctx, tx, sp, schema, table, began, lockTimeout, longer, err)
	}
	return sp.Commit(ctx)
}

// lockWaitError turns err, a statement's failure in the savepoint sp of
// tx, into one that names the sessions holding locks on table (every
// table of schema when table is empty) when the statement, begun at
// began, gave up waiting for a lock; longer says how to wait longer. sp is
// rolled back. The sessions whose transactions began after the statement
// are left out: they did not hold it up (they queued behind it, and took
// their locks as it gave up: producers, mostly).
func lockWaitError(ctx context.Context, tx, sp pgx.Tx, schema, table string, began time.Time, lockTimeout time.Duration, longer string, err error) error {
	// lock_not_available, or query_canceled by a statement_timeout shorter
	// than the lock timeout (a role's, say).
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || (pgErr.Code != "55P03" && pgErr.Code != "57014") {
		return err
	}
	if sp.Rollback(ctx) != nil {
		return err
	}
	rows, qerr := tx.Query(ctx, `SELECT a.pid, coalesce(a.usename, ''), coalesce(a.application_name, ''), coalesce(a.state, ''),
    coalesce(extract(epoch FROM clock_timestamp() - a.xact_start)::bigint, 0), coalesce(left(a.query, 120), ''),
    array_agg(DISTINCT c.relname::text ORDER BY c.relname::text)
FROM pg_locks l
JOIN pg_class c ON c.oid = l.relation AND c.relkind IN ('r', 'p')
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.granted AND l.pid <> pg_backend_pid() AND c.relnamespace = to_regnamespace($1)
    AND ($2 = '' OR c.relname = $2) AND a.xact_start < $3
GROUP BY 1, 2, 3, 4, 5, 6
ORDER BY a.pid`, pgx.Identifier{schema}.Sanitize(), table, began)
	if qerr != nil {
		return err
	}
	var holders []string
	var pid, age int64
	var user, app, state, query string
	var rels []string
	_, qerr = pgx.ForEachRow(rows, []any{&pid, &user, &app, &state, &age, &query, &rels}, func() error {
		holders = append(holders, fmt.Sprintf("pid %d (user %s, application %q, %s, transaction open %ds, last query %q) holds %s",
			pid, user, app, state, age, query, strings.Join(rels, ", ")))
		return nil
	})
	what, them := "the tables", "them"
	if table != "" {
		what, them = table, "it"
	}
	if qerr != nil || len(holders) == 0 {
		holders = []string{"sessions no longer there"}
	}
	return fmt.Errorf("gave up after %s waiting for a lock on %s (the sessions that would use %s queue behind the wait), held by %s: "+
		"let those transactions end, or end them, and retry (wait longer: %s): %w",
		lockTimeout, what, them, strings.Join(holders, "; "), longer, err)
}

// dropTable finds the tables a migration's revert drops.
var dropTable = regexp.MustCompile(`(?i)DROP\s+TABLE\s+(?:IF\s+EXISTS\s+)?([a-z_]+)`)

// droppedTables returns the tables the reverts of steps drop.
func droppedTables(steps []Migration) map[string]bool {
	out := map[string]bool{}
	for _, m := range steps {
		for _, match := range dropTable.FindAllStringSubmatch(m.Down, -1) {
			out[match[1]] = true
		}
	}
	return out
}

// unknownVersions returns the versions applied (done) that are not among
// all, in order.
func unknownVersions(all []Migration, done map[int]time.Time) []int {
	known := make(map[int]bool, len(all))
	for _, m := range all {
		known[m.Version] = true
	}
	var out []int
	for v := range done {
		if !known[v] {
			out = append(out, v)
		}
	}
	sort.Ints(out)
	return out
}

// List reports every known migration and when it was applied to schema,
// then any applied version this onceflow does not know (a newer onceflow's:
// its Name as recorded, no SQL).
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
	names := map[int]string{}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		restoreDateStyle, err := isoDateStyle(ctx, tx)
		if err != nil {
			return err
		}
		table := pgx.Identifier{schema, "schema_migrations"}.Sanitize()
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil {
			return err
		}
		if !exists {
			return restoreDateStyle()
		}
		rows, err := tx.Query(ctx, `SELECT version, name, applied_at FROM `+table)
		if err != nil {
			return err
		}
		var v int
		var name string
		var at time.Time
		if _, err = pgx.ForEachRow(rows, []any{&v, &name, &at}, func() error { done[v], names[v] = at, name; return nil }); err != nil {
			return err
		}
		return restoreDateStyle()
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
	for _, v := range unknownVersions(all, done) {
		at := done[v]
		out = append(out, Status{Migration: Migration{Version: v, Name: names[v]}, AppliedAt: &at})
	}
	return out, nil
}

// ValidateSchema rejects schema names that cannot be a PostgreSQL identifier
// or that would name another schema than the one they spell.
func ValidateSchema(schema string) error {
	switch {
	case schema == "":
		return errors.New("schema name is empty")
	case len(schema) > 63:
		return fmt.Errorf("schema name %q is longer than 63 bytes", schema)
	case strings.ContainsFunc(schema, func(r rune) bool { return r < 0x20 || r == 0x7f }):
		// A line break would end the printed script's comment naming it.
		return fmt.Errorf("schema name %q contains a control character", schema)
	case strings.TrimFunc(schema, invisible) != schema:
		// A templated ONCEFLOW_SCHEMA="onceflow " made a second schema
		// beside the producers' one, and a relay ran healthy on it
		// publishing nothing.
		return fmt.Errorf("schema name %q begins or ends with a blank or an invisible character", schema)
	case schema == "$user":
		// In a search_path, "$user" means the current role's schema.
		return errors.New(`schema name "$user" names the current role's schema in a search_path; choose another`)
	}
	return nil
}

// invisible reports a blank, or a character that shows nothing (a BOM, a
// zero-width space: Unicode's format characters).
func invisible(r rune) bool { return unicode.IsSpace(r) || unicode.Is(unicode.Cf, r) }

// versionTableSQL creates the version table; search_path names the schema.
const versionTableSQL = `CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now())`

// isoDateStyle sets tx's DateStyle to ISO until the transaction ends and
// returns what puts the caller's back. In exec and simple_protocol mode
// (README's advice behind PgBouncer, and `onceflow migrate`'s) PostgreSQL
// sends timestamps as text in the session's DateStyle, and pgx reads only
// ISO: under a legacy application's German or SQL style every step failed
// reading the server's clock. The setting is the transaction's own; in a
// caller's transaction (a savepoint) it would outlive this call, hence the
// restore.
func isoDateStyle(ctx context.Context, tx pgx.Tx) (restore func() error, err error) {
	var style string
	if err := tx.QueryRow(ctx, `SELECT current_setting('DateStyle'), set_config('DateStyle', 'ISO, MDY', true)`).Scan(&style, nil); err != nil {
		return nil, fmt.Errorf("migrations: set DateStyle: %w", err)
	}
	return func() error {
		if _, err := tx.Exec(ctx, `SELECT set_config('DateStyle', $1, true)`, style); err != nil {
			return fmt.Errorf("migrations: restore DateStyle: %w", err)
		}
		return nil
	}, nil
}

// inLockedTx runs fn in a transaction that holds the schema's migration lock,
// has search_path set to the schema, and sees the applied versions. With
// create false, a missing schema or version table is left missing and fn
// sees no applied versions.
func inLockedTx(ctx context.Context, db Beginner, schema string, create bool, fn func(pgx.Tx, map[int]time.Time) error) error {
	if err := ValidateSchema(schema); err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		// READ COMMITTED whatever the session's default: what is read after
		// a wait (the versions another process applied meanwhile, the rows
		// committed while Down waited for a table's lock) must be what
		// committed during it, where REPEATABLE READ would read the world
		// as it was before the wait.
		if _, err := tx.Exec(ctx, `SET TRANSACTION ISOLATION LEVEL READ COMMITTED`); err != nil {
			return fmt.Errorf("migrations: set isolation: %w", err)
		}
		// The settings made below are the transaction's own (set_config's
		// is_local); in a caller's transaction (db a pgx.Tx: a savepoint)
		// they would outlive this call, so they are put back after fn.
		var lockTimeout, searchPath string
		if err := tx.QueryRow(ctx, `SELECT current_setting('lock_timeout'), current_setting('search_path')`).Scan(&lockTimeout, &searchPath); err != nil {
			return fmt.Errorf("migrations: read settings: %w", err)
		}
		restoreDateStyle, err := isoDateStyle(ctx, tx)
		if err != nil {
			return err
		}
		restore := func(err error) error {
			if err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true), set_config('search_path', $2, true)`, lockTimeout, searchPath); err != nil {
				return fmt.Errorf("migrations: restore settings: %w", err)
			}
			return restoreDateStyle()
		}
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('onceflow.migrate.' || $1, 0))`, schema); err != nil {
			return fmt.Errorf("migrations: take lock: %w", err)
		}
		ident := pgx.Identifier{schema}.Sanitize()
		// What exists decides what is created: only what is missing, since
		// PostgreSQL checks the privilege to create a schema or a table
		// (which a service role using its schema often lacks) before IF
		// NOT EXISTS looks.
		var hasSchema, hasVersions, hasOutbox bool
		if err := tx.QueryRow(ctx, `SELECT to_regnamespace($1) IS NOT NULL, to_regclass($2) IS NOT NULL, to_regclass($3) IS NOT NULL`,
			ident, pgx.Identifier{schema, "schema_migrations"}.Sanitize(), pgx.Identifier{schema, "outbox"}.Sanitize()).Scan(&hasSchema, &hasVersions, &hasOutbox); err != nil {
			return fmt.Errorf("migrations: look up schema %s: %w", ident, err)
		}
		if create && hasOutbox && !hasVersions {
			// Tables applied from the files by another tool: applying
			// 0001 would fail on them. Check's advice says how to record
			// what was applied.
			all, err := All()
			if err != nil {
				return err
			}
			return &MissingError{Schema: schema, Missing: all, NoVersionTable: true, Tables: true}
		}
		if create && !hasSchema {
			if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+ident); err != nil {
				return fmt.Errorf("migrations: create schema %s: %w", ident, err)
			}
		}
		// public stays on the path for gen_random_uuid and extensions, but
		// not for a revert: its DROP ... IF EXISTS of a table the schema
		// lacks would find public's.
		path := ident + ", public"
		if !create {
			path = ident
		}
		if _, err := tx.Exec(ctx, `SELECT set_config('search_path', $1, true)`, path); err != nil {
			return fmt.Errorf("migrations: set search_path: %w", err)
		}
		done := map[int]time.Time{}
		if !hasVersions {
			if !create {
				return restore(fn(tx, done))
			}
			if _, err := tx.Exec(ctx, versionTableSQL); err != nil {
				return fmt.Errorf("migrations: create version table: %w", err)
			}
		}
		rows, err := tx.Query(ctx, `SELECT version, applied_at FROM schema_migrations`)
		if err != nil {
			return fmt.Errorf("migrations: read versions: %w", err)
		}
		var v int
		var at time.Time
		if _, err := pgx.ForEachRow(rows, []any{&v, &at}, func() error { done[v] = at; return nil }); err != nil {
			return fmt.Errorf("migrations: read versions: %w", err)
		}
		return restore(fn(tx, done))
	})
}
