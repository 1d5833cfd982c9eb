package idempotency_test

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/idempotency"
)

// storeBlip makes storing a result fail, as a database blip would, from
// start() until about d later: a trigger refuses every update that
// finishes a claim while a flag row says so. Renewals and claims pass.
func storeBlip(t *testing.T, b bundle, d time.Duration) (start func()) {
	t.Helper()
	ctx := context.Background()
	flag := pgx.Identifier{b.schema, "store_fails"}.Sanitize()
	fn := pgx.Identifier{b.schema, "refuse_store"}.Sanitize()
	for _, sql := range []string{
		`CREATE TABLE ` + flag + ` (on_ boolean NOT NULL)`,
		`INSERT INTO ` + flag + ` VALUES (false)`,
		`CREATE FUNCTION ` + fn + `() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (SELECT on_ FROM ` + flag + `) THEN
        RAISE EXCEPTION 'injected: the database is away';
    END IF;
    RETURN NEW;
END $$`,
		`CREATE TRIGGER refuse_store BEFORE UPDATE ON ` + pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize() +
			` FOR EACH ROW WHEN (NEW.state <> 'running') EXECUTE FUNCTION ` + fn + `()`,
	} {
		if _, err := b.pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	set := func(on bool) error {
		_, err := b.pool.Exec(ctx, `UPDATE `+flag+` SET on_ = $1`, on)
		return err
	}
	var ended sync.WaitGroup
	t.Cleanup(ended.Wait)
	return func() {
		if err := set(true); err != nil {
			t.Error(err)
			return
		}
		ended.Add(1)
		go func() {
			defer ended.Done()
			time.Sleep(d)
			if err := set(false); err != nil {
				t.Error(err)
			}
		}()
	}
}

// In Leased mode the handler's effect has happened when its answer is
// stored. A store that fails once (a blip shorter than the lease) must be
// tried again: left unstored, the key stays running until its lease
// lapses and the client's retry runs the handler (the charge) again.
func TestLeasedResultIsStoredThroughABriefDatabaseBlip(t *testing.T) {
	t.Parallel()
	b := setup(t)
	blip := storeBlip(t, b, 700*time.Millisecond)
	var runs atomic.Int64
	srv := newServer(t, b, idempotency.Config{Mode: idempotency.Leased, Lease: 2 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1) // the charge
			blip()
			w.WriteHeader(http.StatusCreated)
		})
	if first := send(t, srv, request{key: "k", body: "{}"}); first.status != http.StatusCreated {
		t.Fatalf("first: %d", first.status)
	}
	var retry response
	waitFor(t, 20*time.Second, "the retry to stop answering 409", func() bool {
		retry = send(t, srv, request{key: "k", body: "{}"})
		return retry.status != http.StatusConflict
	})
	if retry.status != http.StatusCreated || !retry.replayed || runs.Load() != 1 {
		t.Fatalf("retry after the blip: %d replayed=%v; handler ran %d times, want a replayed 201 and 1 run",
			retry.status, retry.replayed, runs.Load())
	}
}

// The same for Fence.Do: fn charged the card; the result must be stored
// once the database is back within the lease, not lost to one failed
// statement.
func TestDoResultIsStoredThroughABriefDatabaseBlip(t *testing.T) {
	t.Parallel()
	b := setup(t)
	blip := storeBlip(t, b, 700*time.Millisecond)
	f := newFence(t, b, idempotency.FenceConfig{Lease: 2 * time.Second})
	var runs atomic.Int64
	fn := func(context.Context) ([]byte, error) {
		if runs.Add(1) == 1 {
			blip()
		}
		return []byte("receipt"), nil
	}
	got, err := f.Do(context.Background(), "charge", fn)
	if err != nil || string(got) != "receipt" {
		t.Fatalf("first Do through the blip: %q, %v; want the receipt and no error", got, err)
	}
	var again []byte
	waitFor(t, 20*time.Second, "the key to stop being in progress", func() bool {
		again, err = f.Do(context.Background(), "charge", fn)
		return err == nil
	})
	if string(again) != "receipt" || runs.Load() != 1 {
		t.Fatalf("second Do: %q; fn ran %d times, want the stored receipt and 1 run", again, runs.Load())
	}
}
