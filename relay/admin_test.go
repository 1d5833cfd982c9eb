package relay_test

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

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
