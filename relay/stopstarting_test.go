package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/onceflow/onceflow/relay"
)

// TestAStopWhileStartingHandsBackWhatTheFirstLeaseRoundWrote: the first
// lease round's statements commit one by one, so a round that fails after
// its heartbeat has written the instance row (here every shard take fails)
// leaves that row leased. A stop while Run retries that round returns nil
// and must hand back, as any stop does, rather than leave the row (and any
// shard taken) to lapse.
func TestAStopWhileStartingHandsBackWhatTheFirstLeaseRoundWrote(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	if _, err := b.pool.Exec(ctx, `CREATE FUNCTION `+b.schema+`.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'shards refused (test)'; END $$;
CREATE TRIGGER refuse BEFORE UPDATE ON `+b.schema+`.relay_shards FOR EACH ROW EXECUTE FUNCTION `+b.schema+`.refuse()`); err != nil {
		t.Fatal(err)
	}
	r, err := relay.New(b.pool, b.publisher(t), &relay.Config{Schema: b.schema, InstanceID: "starting", LeaseDuration: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	waitFor(t, "the first lease round to write the instance row", 30*time.Second, func() bool { return b.count(t, "relay_instances") == 1 })
	stop()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run stopped while starting: %v, want nil", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return within 30 s of its stop")
	}
	if n := b.count(t, "relay_instances"); n != 0 {
		t.Fatalf("%d instance rows left after a stop while starting, want the row handed back (it would hold the id for the hour's lease)", n)
	}
}
