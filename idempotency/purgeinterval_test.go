package idempotency_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
)

// countingPool is the real pool, counting the statements Exec runs.
type countingPool struct {
	*pgxpool.Pool
	execs atomic.Int64
}

func (c *countingPool) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	c.execs.Add(1)
	return c.Pool.Exec(ctx, sql, args...)
}

// helper 98: PurgeConfig.Interval is a time.Duration, and NewPurger takes
// any positive one: Interval: 60 (meant as seconds, or copied from a
// config file's bare number) is 60 ns, and Run then purges back to back,
// a DELETE against idempotency_keys as fast as the database answers, for
// ever. consumer.NewJanitor refuses intervals under a second for this very
// reason (CHANGELOG); the Purger, doing the same job for this table, does
// not.
func TestNewPurgerRefusesAnIntervalMeantAsSeconds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := &countingPool{Pool: b.pool}
	p, err := idempotency.NewPurger(db, &idempotency.PurgeConfig{Schema: b.schema, Interval: 60})
	if err != nil {
		if !strings.Contains(err.Error(), "PurgeConfig.Interval") {
			t.Errorf("refused, but the error does not name the field: %v", err)
		}
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	_ = p.Run(ctx)
	t.Fatalf("NewPurger accepted Interval 60 (= 60ns); Run then sent %d purge statements in 0.5 s", db.execs.Load())
}
