package relay_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
)

// ReplayDead and DiscardDead take all the given ids or none, naming the
// ones that are not dead events; an empty id list is never "all".
func TestDeadAdminTakesAllIDsOrNone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	for range 2 {
		if _, err := b.pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{b.schema, "outbox_dead"}.Sanitize()+
			` (outbox_id, event_id, topic, value, created_at, error, attempts) VALUES (1, gen_random_uuid(), 't', 'v', now(), 'refused', 1)`); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := relay.ReplayDead(ctx, b.pool, b.schema, []int64{}); err == nil || n != 0 {
		t.Fatalf("ReplayDead with an empty list: moved %d, err %v", n, err)
	}
	var nf *relay.DeadNotFoundError
	n, err := relay.ReplayDead(ctx, b.pool, b.schema, []int64{1, 7, 9})
	if !errors.As(err, &nf) || n != 0 || !slices.Equal(nf.IDs, []int64{7, 9}) {
		t.Fatalf("ReplayDead 1,7,9: moved %d, err %v", n, err)
	}
	gone, err := relay.DiscardDead(ctx, b.pool, b.schema, []int64{2, 8})
	if !errors.As(err, &nf) || len(gone) != 0 || !slices.Equal(nf.IDs, []int64{8}) {
		t.Fatalf("DiscardDead 2,8: %v, err %v", gone, err)
	}
	if b.count(t, "outbox_dead") != 2 || b.count(t, "outbox") != 0 {
		t.Fatal("a refused call changed something")
	}
	if gone, err = relay.DiscardDead(ctx, b.pool, b.schema, []int64{2}); err != nil || len(gone) != 1 || gone[0].ID != 2 || string(gone[0].Value) != "v" {
		t.Fatalf("DiscardDead 2: %v, err %v", gone, err)
	}
	if n, err = relay.ReplayDead(ctx, b.pool, b.schema, nil); err != nil || n != 1 {
		t.Fatalf("ReplayDead all: moved %d, err %v", n, err)
	}
}

// ReadStatus says what time the database's clock showed, so that ages are
// measured on the clock that stamped created_at and heartbeat_at, not on an
// operator's laptop's (helper 86).
func TestReadStatusGivesTheDatabasesClock(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	ctx := context.Background()
	tx, err := pgtest.Pool(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	var created time.Time
	if err := tx.QueryRow(ctx, `INSERT INTO `+pgx.Identifier{schema, "outbox"}.Sanitize()+` (topic, key, value) VALUES ('t', 'k', 'v') RETURNING created_at`).Scan(&created); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	st, err := relay.ReadStatus(ctx, tx, schema)
	if err != nil {
		t.Fatal(err)
	}
	if !st.ReadAt.Equal(created) {
		t.Errorf("ReadAt %v, want the database's now() %v (the transaction's start)", st.ReadAt, created)
	}
	b, err := relay.ReadBacklog(ctx, tx, schema, relay.EveryShard())
	if err != nil {
		t.Fatal(err)
	}
	if !b.ReadAt.Equal(created) {
		t.Errorf("Backlog.ReadAt %v, want the database's now() %v", b.ReadAt, created)
	}
}
