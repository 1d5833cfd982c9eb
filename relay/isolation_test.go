package relay_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
)

// A database or role defaulting to SERIALIZABLE or REPEATABLE READ (as a
// payments team may set for its application) reached the relay's
// sessions, and its statements, written for READ COMMITTED (a lock or an
// UPDATE re-checks the newest row version; SKIP LOCKED passes over a
// taken shard), failed with serialization failures: under SERIALIZABLE,
// three relays draining 3,000 events logged dozens of "published but their
// outcome could not be recorded; they will be published again" (duplicates
// in Kafka) and failed lease renewals (leases lapsing) within 3 s. The
// relay now refuses to start under any other default isolation, naming
// the setting and the statement that mends it.
func TestRelayRefusesSessionsNotDefaultingToReadCommitted(t *testing.T) {
	for _, level := range []string{"repeatable read", "serializable"} {
		t.Run(level, func(t *testing.T) {
			b := setup(t)
			pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) {
				cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = level
			})
			r, err := relay.New(pool, b.publisher(t), &relay.Config{Schema: b.schema, LeaseDuration: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			err = r.Run(ctx)
			if !errors.Is(err, relay.ErrIsolationSetting) || !strings.Contains(err.Error(), level) ||
				!strings.Contains(err.Error(), "ALTER ROLE") {
				t.Fatalf("Run under default_transaction_isolation %q returned %v; want relay.ErrIsolationSetting naming the level and ALTER ROLE", level, err)
			}
			var owned int
			if err := b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{b.schema, "relay_shards"}.Sanitize()+
				` WHERE owner IS NOT NULL`).Scan(&owned); err != nil {
				t.Fatal(err)
			}
			if owned != 0 {
				t.Fatalf("the refused relay took %d shards", owned)
			}
		})
	}
}
