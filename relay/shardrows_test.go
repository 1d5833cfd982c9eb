package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// Rows of relay_shards deleted by hand (an operator "resetting" the
// leases) were never written again: the relays only UPDATE that table, so
// the keys of those shards waited for good, and status counted no unowned
// shard (it counted rows). The lease tick now writes the missing rows back
// (helper 70's TestH70DeletedShardRowsStallForever: 65 of 2,000 events
// pending for good, unowned_shards=0).
func TestDeletedShardRowsAreWrittenBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	topic := b.kafka.Topic(t, 4)
	shards := pgx.Identifier{b.schema, "relay_shards"}.Sanitize()
	write := func(from, n int) {
		msgs := make([]outbox.Message, n)
		for i := range msgs {
			msgs[i] = outbox.Message{Topic: topic, Key: fmt.Appendf(nil, "key-%d", (from+i)%500), Value: fmt.Appendf(nil, "v%d", from+i)}
		}
		b.write(t, msgs...)
	}
	drained := func(what string) {
		waitFor(t, what, 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	}

	// Deleted before the relay starts.
	if _, err := b.pool.Exec(ctx, `DELETE FROM `+shards+` WHERE shard < 16`); err != nil {
		t.Fatal(err)
	}
	st, err := relay.ReadStatus(ctx, b.pool, b.schema)
	if err != nil {
		t.Fatal(err)
	}
	bl, err := relay.ReadBacklog(ctx, b.pool, b.schema, relay.EveryShard())
	if err != nil {
		t.Fatal(err)
	}
	if st.UnownedShards != relay.NumShards || bl.UnownedShards != relay.NumShards {
		t.Fatalf("no relay runs: status counts %d unowned shards, the backlog %d; want %d", st.UnownedShards, bl.UnownedShards, relay.NumShards)
	}
	write(0, 1000)
	b.startRelay(t, relay.Config{})
	drained("the events written after 16 shard rows were deleted to be published")

	// Deleted while it runs, owned.
	if _, err := b.pool.Exec(ctx, `DELETE FROM `+shards+` WHERE shard >= 240`); err != nil {
		t.Fatal(err)
	}
	write(1000, 1000)
	drained("the events written after 16 owned shard rows were deleted to be published")

	waitFor(t, "the deleted rows of relay_shards to be written back and taken", 30*time.Second, func() bool {
		st, err := relay.ReadStatus(ctx, b.pool, b.schema)
		if err != nil {
			t.Fatal(err)
		}
		return b.count(t, "relay_shards") == relay.NumShards && st.UnownedShards == 0
	})
	records := b.kafka.ReadAll(t, topic, 2000, 30*time.Second)
	if len(records) < 2000 {
		t.Fatalf("read %d records back, want 2000", len(records))
	}
}
