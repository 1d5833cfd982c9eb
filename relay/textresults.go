package relay

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrTextResultSettings is returned by Run at start (wrapped, naming each
// setting, its value and the statement that mends it) when the pool's
// DefaultQueryExecMode is exec or simple_protocol, in which PostgreSQL
// sends results as text, and the database writes bytea or timestamps in a
// text form pgx cannot read: a bytea_output other than 'hex', or a
// DateStyle other than ISO (SQL, German, Postgres), as a database or role
// may carry for a legacy application. Under them every read of the outbox
// and of the leases failed with a scan error ("invalid hex format",
// "invalid PostgreSQL date/time value") and was retried forever, publishing
// nothing. Set them on the relay's role: every new session of the role
// applies them, also the server connections a pooler such as PgBouncer
// opens, where a SET in the pool's AfterConnect reaches only one of them.
// The binary-result modes (pgx's default, cache_statement) are not
// affected.
var ErrTextResultSettings = errors.New("relay: in exec and simple_protocol mode PostgreSQL sends results as text, " +
	"which pgx reads only under bytea_output = 'hex' and an ISO DateStyle")

// textResults reports whether pgx receives results as text in mode.
func textResults(mode pgx.QueryExecMode) bool {
	return mode == pgx.QueryExecModeExec || mode == pgx.QueryExecModeSimpleProtocol
}

// checkTextSettings returns an error wrapping ErrTextResultSettings if
// pool's results come as text (textResults) in a form pgx cannot read;
// nil in the binary-result modes, without asking the database.
func checkTextSettings(ctx context.Context, pool *pgxpool.Pool) error {
	if !textResults(pool.Config().ConnConfig.DefaultQueryExecMode) {
		return nil
	}
	var byteaOutput, dateStyle, role string
	if err := pool.QueryRow(ctx, `SELECT current_setting('bytea_output'), current_setting('DateStyle'), session_user`).Scan(&byteaOutput, &dateStyle, &role); err != nil {
		return fmt.Errorf("relay: read bytea_output and DateStyle: %w", err)
	}
	return textSettingsError(byteaOutput, dateStyle, role)
}

// textSettingsError is checkTextSettings' verdict on the settings read.
func textSettingsError(byteaOutput, dateStyle, role string) error {
	var bad []string
	quoted := pgx.Identifier{role}.Sanitize()
	if byteaOutput != "hex" {
		bad = append(bad, fmt.Sprintf("bytea_output is %q: run ALTER ROLE %s SET bytea_output = 'hex'", byteaOutput, quoted))
	}
	if !strings.HasPrefix(dateStyle, "ISO") {
		bad = append(bad, fmt.Sprintf("DateStyle is %q: run ALTER ROLE %s SET DateStyle = 'ISO, MDY'", dateStyle, quoted))
	}
	if len(bad) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s (a role's setting reaches each new session, through PgBouncer too, unless the connection string "+
		"or ALTER ROLE ... IN DATABASE sets it otherwise; without a pooler in transaction mode, pgx's default query mode reads "+
		"binary results and needs neither)", ErrTextResultSettings, strings.Join(bad, "; "))
}
