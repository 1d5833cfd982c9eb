package relay

import (
	"context"
	"crypto/sha256"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// An event's id is handed out before its transaction commits, and the
// transaction may take it long before: a long transaction, a BEFORE
// trigger that waits (the id default is evaluated first), or nextval
// called early and the row inserted later with that id. Whatever the floor
// reads carried from claim to claim (their base, or anything proved about
// the rows below it), an event that commits late below it is read, before
// every later event of its key, and the claims read exactly the oldest
// pending events not blocked, claim after claim.
func TestClaimFromTheFloorReadsAnIdTakenEarlyThatCommitsLate(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		// take starts a transaction holding an id of the late key and
		// returns what commits it (returning the id).
		take func(t *testing.T, ctx context.Context, schema, outbox string) (commit func() int64)
	}{
		{"a long transaction", func(t *testing.T, ctx context.Context, _, outbox string) func() int64 {
			conn := pgtest.Conn(t)
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var id int64
			if err := tx.QueryRow(ctx, `INSERT INTO `+outbox+` (topic, key) VALUES ('t', 'late-key') RETURNING id`).Scan(&id); err != nil {
				t.Fatal(err)
			}
			return func() int64 {
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				return id
			}
		}},
		{"a BEFORE trigger that waits after the id was taken", func(t *testing.T, ctx context.Context, schema, outbox string) func() int64 {
			// The trigger waits for an advisory lock this test holds: the
			// writer's transaction has its id and no xid yet (nothing
			// written), for as long as the test likes.
			holder, writer := pgtest.Conn(t), pgtest.Conn(t)
			var lockKey int64
			if err := holder.QueryRow(ctx, `SELECT hashtext($1)::bigint`, schema).Scan(&lockKey); err != nil {
				t.Fatal(err)
			}
			fn := pgx.Identifier{schema, "hold_late"}.Sanitize()
			if _, err := holder.Exec(ctx, fmt.Sprintf(`CREATE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.value = 'hold' THEN PERFORM pg_advisory_xact_lock(%d); END IF;
    RETURN NEW;
END $$`, fn, lockKey)); err != nil {
				t.Fatal(err)
			}
			if _, err := holder.Exec(ctx, `CREATE TRIGGER hold_late BEFORE INSERT ON `+outbox+` FOR EACH ROW EXECUTE FUNCTION `+fn+`()`); err != nil {
				t.Fatal(err)
			}
			if _, err := holder.Exec(ctx, `SELECT pg_advisory_lock($1)`, lockKey); err != nil {
				t.Fatal(err)
			}
			type result struct {
				id  int64
				err error
			}
			done := make(chan result, 1)
			go func() {
				var id int64
				err := writer.QueryRow(ctx, `INSERT INTO `+outbox+` (topic, key, value) VALUES ('t', 'late-key', 'hold') RETURNING id`).Scan(&id)
				done <- result{id, err}
			}()
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				var waiting bool
				if err := holder.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity
WHERE pid = $1 AND wait_event_type = 'Lock' AND wait_event = 'advisory')`, writer.PgConn().PID()).Scan(&waiting); err != nil {
					t.Fatal(err)
				}
				if waiting {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the writer did not come to wait in its trigger within 10s")
				}
			}
			return func() int64 {
				if _, err := holder.Exec(ctx, `SELECT pg_advisory_unlock($1)`, lockKey); err != nil {
					t.Fatal(err)
				}
				r := <-done
				if r.err != nil {
					t.Fatal(r.err)
				}
				return r.id
			}
		}},
		{"nextval, then the row inserted with that id", func(t *testing.T, ctx context.Context, _, outbox string) func() int64 {
			conn := pgtest.Conn(t)
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var id int64
			if err := tx.QueryRow(ctx, `SELECT nextval(pg_get_serial_sequence($1, 'id'))`, outbox).Scan(&id); err != nil {
				t.Fatal(err)
			}
			return func() int64 {
				if _, err := tx.Exec(ctx, `INSERT INTO `+outbox+` (id, topic, key) OVERRIDING SYSTEM VALUE VALUES ($1, 't', 'late-key')`, id); err != nil {
					t.Fatal(err)
				}
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				return id
			}
		}},
	} {
		for _, shape := range []readShape{shapeFloor, shapeAll, shapeShards} {
			name := c.name + ", from the floor beside a blocked key"
			owned := everyShard()
			switch shape {
			case shapeAll:
				name = c.name + ", every shard owned and none blocked, a read-ahead"
			case shapeShards:
				// A quarter of the shards, the late key's among them: one
				// index range per shard, each from a floor proof's id
				// once one holds it.
				name = c.name + ", a quarter of the shards owned, a read-ahead"
				late := int16(sha256.Sum256([]byte("late-key"))[0])
				owned = owned[:0]
				for sh := late; len(owned) < NumShards/4; sh = (sh + 1) % NumShards {
					owned = append(owned, sh)
				}
				slices.Sort(owned)
			}
			all := shape != shapeFloor // a read-ahead, nothing blocked
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				ctx, st, outbox, insert, blocked := claimFloorCase(t)
				if all {
					// One relay draining every shard: the primary key in
					// id order (claimAllQuery), each claim leaving out the
					// round still in flight.
					if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE key = 'stuck'`); err != nil {
						t.Fatal(err)
					}
					blocked = nil
				}
				schema := outboxSchema(t, st, outbox)
				commit := c.take(t, ctx, schema, outbox)
				// Enough events in the owned shards that the claims do not
				// reach the late key's next event before the late commit.
				events := 4000 * NumShards / len(owned)
				if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ('k' || (g % 40))::bytea FROM generate_series(1, $1) g`, events); err != nil {
					t.Fatal(err)
				}
				after := insert(st.pool, "late-key") // the late key's next event, committed first
				var inFlight []int64
				claim := func(what string, checkShape bool) []int64 {
					t.Helper()
					var excluded []int64
					if all {
						excluded = slices.Clone(inFlight)
					}
					stmts := st.claimStatements(owned, 50, blocked, slices.Clone(excluded))
					switch {
					case !checkShape:
					case shape == shapeFloor && !stmts[0].floor:
						t.Fatalf("%s: the free shards are not read from their floor", what)
					case shape == shapeAll && (len(stmts) != 1 || stmts[0].floor || strings.Contains(stmts[0].sql, "o.shard")):
						t.Fatalf("%s: not read through the primary key in id order", what)
					case shape == shapeShards && (len(stmts) != 1 || !stmts[0].shards):
						t.Fatalf("%s: not read as one index range per owned shard", what)
					}
					got := claimedIDs(t, st, owned, 50, blocked, slices.Clone(excluded))
					if want := oldestFreeIn(t, st, outbox, 50, excluded, owned); !slices.Equal(got, want) {
						t.Fatalf("%s read %v, want %v", what, got, want)
					}
					if slices.Contains(got, after) {
						t.Fatalf("%s read the late key's event %d before its earlier one", what, after)
					}
					// The round before lands; this one is in flight.
					land := got
					if all {
						land, inFlight = inFlight, got
					}
					if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, land); err != nil {
						t.Fatal(err)
					}
					return got
				}
				// Claims while the late id is held, long enough for
				// anything carried from claim to claim to settle (a
				// claim a few milliseconds apart, as a relay draining a
				// backlog).
				for i := range 24 {
					claim(fmt.Sprintf("claim %d", i), true)
					time.Sleep(2 * time.Millisecond)
				}
				lateID := commit()
				if base := st.floorBase(); !all && base <= lateID {
					t.Fatalf("floor base %d, want one above the late id %d for this test", base, lateID)
				}
				got := claim("claim after the late commit", false)
				if len(got) == 0 || got[0] != lateID {
					t.Fatalf("claim after the late commit read %v, want the late event %d first", got, lateID)
				}
				// And claim after claim: whatever a claim carries over
				// (a floor proof, once the late id's transaction has
				// ended) reads the oldest pending events.
				for i := range 24 {
					claim(fmt.Sprintf("claim %d after the late commit", i), false)
					time.Sleep(2 * time.Millisecond)
				}
				if shape == shapeShards && st.proof.below == 0 {
					t.Fatal("no floor proof held after 24 claims of a quarter of the shards: the late commit was read without one")
				}
			})
		}
	}
}

// outboxSchema returns the schema of the store's outbox.
func outboxSchema(t *testing.T, st *store, outbox string) string {
	t.Helper()
	var schema string
	if err := st.pool.QueryRow(context.Background(), `SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1::regclass`, outbox).Scan(&schema); err != nil {
		t.Fatal(err)
	}
	return schema
}

// Once no transaction that took an id below the floor reads' base is left,
// the floor reads stop descending the shards found with nothing pending
// below it (claimproof.go), and read the same rounds. A shard that had
// events pending below it when that was found keeps its descent, so the
// claims read its old events first whenever it comes free: a blocked
// key's shard once the key is released, a shard taken over from another
// relay, and events a round had in flight that come back for a retry.
func TestClaimFromTheFloorDescendsOnlyWhatANewFloorProofLeavesOpen(t *testing.T) {
	t.Parallel()
	ctx, st, outbox, insert, blocked := claimFloorCase(t)
	used := map[byte]bool{sha256.Sum256([]byte("stuck"))[0]: true}
	key := func(prefix string) (string, int16) {
		for i := 0; ; i++ {
			k := fmt.Sprintf("%s-%d", prefix, i)
			if sh := sha256.Sum256([]byte(k))[0]; !used[sh] {
				used[sh] = true
				return k, int16(sh)
			}
		}
	}
	heldKey, _ := key("held")
	movedKey, movedShard := key("moved")
	flightKey, flightShard := key("flight")
	var inFlight []int64
	held := keyBlock{key: []byte(heldKey), firstID: insert(st.pool, heldKey)}
	insert(st.pool, heldKey)
	insert(st.pool, movedKey)
	insert(st.pool, movedKey)
	inFlight = append(inFlight, insert(st.pool, flightKey), insert(st.pool, flightKey))
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ('k' || (g % 40))::bytea FROM generate_series(1, 2000) g`); err != nil {
		t.Fatal(err)
	}
	owned := slices.DeleteFunc(everyShard(), func(sh int16) bool { return sh == movedShard })
	before := append(slices.Clone(blocked), held)
	for i := 0; st.proof.below == 0; i++ {
		if i == 40 {
			t.Fatal("no floor proof after 40 floor reads with no transaction holding an id")
		}
		if stmts := st.claimStatements(owned, 50, before, slices.Clone(inFlight)); !stmts[0].floor {
			t.Fatalf("claim %d: the free shards are not read from their floor", i)
		}
		got := claimedIDs(t, st, owned, 50, before, slices.Clone(inFlight))
		if len(got) == 0 {
			t.Fatal("the backlog ran out before a floor proof")
		}
		if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, got); err != nil {
			t.Fatal(err)
		}
	}
	stmts := st.claimStatements(owned, 50, before, slices.Clone(inFlight))
	// Of the free shards only the one with events in flight below the
	// proof's id (pending) is descended.
	if descend := stmts[0].args[0].([]int16); !slices.Equal(descend, []int16{flightShard}) {
		t.Errorf("with a floor proof, the floor read descends %v, want only the shard with events in flight below it (%d)", descend, flightShard)
	}
	// The held key released, the moved shard taken over, the events in
	// flight back for a retry: their shards were not in the proof.
	st.lastFull = true
	stmts = st.claimStatements(everyShard(), 50, blocked, nil)
	if !stmts[0].floor {
		t.Fatal("the free shards are not read from their floor")
	}
	if descend := stmts[0].args[0].([]int16); len(descend) != 3 {
		t.Errorf("the floor read descends %v, want the three shards that had events below the proof's id", descend)
	}
	got := claimedIDs(t, st, everyShard(), 50, blocked, nil)
	if want := oldestFree(t, st, outbox, 50, nil); !slices.Equal(got, want) {
		t.Fatalf("claim read %v, want %v", got, want)
	}
	if len(got) < 6 || !slices.Contains(got[:6], held.firstID) || !slices.Contains(got[:6], inFlight[0]) {
		t.Fatalf("claim read %v, want the six old events of the shards come free first", got)
	}
}

// One relay draining every shard with nothing blocked reads through the
// primary key in id order. Once no transaction that took an id below the
// rounds is left, a floor proof holds every shard and the claims start at
// its id (the dead entries of the rows the drain deleted are not walked),
// and read the same rounds; the proof's id follows the rounds.
func TestClaimAllStartsAtAFloorProofThatHoldsEveryShard(t *testing.T) {
	t.Parallel()
	ctx, st, schema, _ := claimSetup(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := st.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ('k' || g)::bytea FROM generate_series(1, 6000) g`); err != nil {
		t.Fatal(err)
	}
	var inFlight []int64
	var bounds []int64
	for i := 0; ; i++ {
		stmts := st.claimStatements(everyShard(), 50, nil, slices.Clone(inFlight))
		if len(stmts) != 1 || !stmts[0].all {
			t.Fatalf("claim %d: not read through the primary key in id order", i)
		}
		if st.proof.holdsAll() {
			bound := stmts[0].args[len(stmts[0].args)-1].(int64)
			if bound != st.proof.below {
				t.Fatalf("claim %d: starts at %d, want the proof's %d", i, bound, st.proof.below)
			}
			if len(bounds) == 0 || bounds[len(bounds)-1] != bound {
				bounds = append(bounds, bound)
			}
		}
		got := claimedIDs(t, st, everyShard(), 50, nil, slices.Clone(inFlight))
		if want := oldestFree(t, st, outbox, 50, inFlight); !slices.Equal(got, want) {
			t.Fatalf("claim %d read %v, want %v", i, got, want)
		}
		if len(got) == 0 {
			break
		}
		if _, err := st.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, inFlight); err != nil {
			t.Fatal(err)
		}
		inFlight = got
	}
	// 120 rounds: a proof at least every claimProofEvery claims or so.
	if len(bounds) < 5 {
		t.Fatalf("the claims started at floor proofs' ids %v, want one following the rounds", bounds)
	}
	if !slices.IsSorted(bounds) {
		t.Fatalf("the proofs' ids %v went back", bounds)
	}
	t.Logf("the claims started at %v", bounds)
}
