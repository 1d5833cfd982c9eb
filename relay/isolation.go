package relay

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrIsolationSetting is returned by Run at start (wrapped, naming the
// level and the statement that mends it) when the pool's sessions default
// to an isolation level other than READ COMMITTED, as a database or role
// set for an application may (payments teams often choose SERIALIZABLE).
// The relay's statements are written for READ COMMITTED: a take passes
// over shards another relay holds locked (SKIP LOCKED), and a lock or an
// UPDATE re-checks the newest version of a row changed since the
// statement began. Under SERIALIZABLE three relays logged dozens of
// outcomes they could not record (their events published again) and
// failed lease renewals within seconds; REPEATABLE READ fails the same
// statements when they race, more rarely.
var ErrIsolationSetting = errors.New("relay: the relay's sessions must default to READ COMMITTED")

// checkIsolation returns an error wrapping ErrIsolationSetting unless
// pool's sessions default to READ COMMITTED.
func checkIsolation(ctx context.Context, pool *pgxpool.Pool) error {
	var level, role string
	if err := pool.QueryRow(ctx, `SELECT current_setting('default_transaction_isolation'), session_user`).Scan(&level, &role); err != nil {
		return fmt.Errorf("relay: read default_transaction_isolation: %w", err)
	}
	if level == "read committed" {
		return nil
	}
	return fmt.Errorf("%w: default_transaction_isolation is %q: run ALTER ROLE %s SET default_transaction_isolation = 'read committed' "+
		"(a role's setting reaches each new session, through PgBouncer too, unless the connection string or "+
		"ALTER ROLE ... IN DATABASE sets it otherwise), or give the relay's pool RuntimeParams[\"default_transaction_isolation\"] = \"read committed\"",
		ErrIsolationSetting, level, pgx.Identifier{role}.Sanitize())
}
