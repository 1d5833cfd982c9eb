package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

func schemaExists(t *testing.T, schema string) bool {
	t.Helper()
	var ok bool
	if err := pgtest.Pool(t).QueryRow(context.Background(), `SELECT to_regnamespace($1) IS NOT NULL`, pgx.Identifier{schema}.Sanitize()).Scan(&ok); err != nil {
		t.Fatal(err)
	}
	return ok
}

// Down refuses to drop a table that holds events, dead letters, dedup
// records or idempotency keys; DownForce drops them.
func TestDownRefusesToDropTablesHoldingRows(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		"outbox":             `INSERT INTO outbox (topic, value) VALUES ('t', 'pending')`,
		"outbox_dead":        `INSERT INTO outbox_dead (outbox_id, event_id, topic, created_at, error, attempts) VALUES (1, gen_random_uuid(), 't', now(), 'refused', 1)`,
		"processed_messages": `INSERT INTO processed_messages (consumer, message_id) VALUES ('c', 'm')`,
	}
	for table, insert := range cases {
		t.Run(table, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := pgtest.Pool(t)
			schema := pgtest.Schema(t)
			if _, err := pool.Exec(ctx, `SET search_path TO `+pgx.Identifier{schema}.Sanitize()+`; `+insert); err != nil {
				t.Fatal(err)
			}
			all, _ := migrations.All()
			reverted, err := migrations.Down(ctx, pool, schema, len(all))
			var lossErr *migrations.DataLossError
			if !errors.As(err, &lossErr) || len(reverted) != 0 {
				t.Fatalf("Down: reverted %v, err %v; want a DataLossError and nothing reverted", reverted, err)
			}
			if !strings.Contains(err.Error(), table) {
				t.Errorf("error %q does not name %s", err, table)
			}
			if !tableExists(t, schema, table) || !tableExists(t, schema, "idempotency_keys") {
				t.Fatal("a refused Down dropped tables")
			}
			if reverted, err = migrations.DownForce(ctx, pool, schema, len(all)); err != nil || len(reverted) != len(all) {
				t.Fatalf("DownForce: reverted %v, err %v", reverted, err)
			}
			if tableExists(t, schema, table) {
				t.Fatalf("%s still exists after DownForce", table)
			}
		})
	}
}

// Down of a step that drops only empty tables needs no force.
func TestDownOfEmptyTablesNeedsNoForce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.Schema(t)
	// relay_shards always holds its 256 rows: it is not user data.
	all, _ := migrations.All()
	if reverted, err := migrations.Down(ctx, pool, schema, len(all)); err != nil || len(reverted) != len(all) {
		t.Fatalf("Down: reverted %v, err %v", reverted, err)
	}
}

// Down on a schema that was never migrated reverts nothing and creates
// nothing: not the schema, not the version table.
func TestDownOnAMissingSchemaCreatesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.EmptySchema(t)
	for _, down := range []func(context.Context, migrations.Beginner, string, int) ([]int, error){migrations.Down, migrations.DownForce} {
		if reverted, err := down(ctx, pool, schema, 1); err != nil || len(reverted) != 0 {
			t.Fatalf("Down: reverted %v, err %v", reverted, err)
		}
		if schemaExists(t, schema) {
			t.Fatal("Down created the schema")
		}
	}
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{schema}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	if reverted, err := migrations.Down(ctx, pool, schema, 1); err != nil || len(reverted) != 0 {
		t.Fatalf("Down on an empty schema: reverted %v, err %v", reverted, err)
	}
	if tableExists(t, schema, "schema_migrations") {
		t.Fatal("Down created the version table")
	}
}

// An event whose transaction commits while Down runs is counted before
// anything is dropped: Down locks the data tables first. It used to count
// them unlocked, wait for the producer at its first ALTER TABLE, and drop
// the outbox with the event that had committed meanwhile.
func TestDownCountsAnEventThatCommitsWhileItWaits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.Schema(t)
	producer, err := pgtest.Conn(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = producer.Rollback(ctx) }()
	if _, err := producer.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "outbox"}.Sanitize()+` (topic, value) VALUES ('t', 'pending')`); err != nil {
		t.Fatal(err)
	}
	all, _ := migrations.All()
	type result struct {
		reverted []int
		err      error
	}
	done := make(chan result, 1)
	go func() {
		reverted, err := migrations.Down(ctx, pool, schema, len(all))
		done <- result{reverted, err}
	}()
	// Down waits for the producer's lock on the outbox.
	waitFor(t, func() bool {
		var waiting bool
		_ = pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE NOT granted AND relation = to_regclass($1))`,
			pgx.Identifier{schema, "outbox"}.Sanitize()).Scan(&waiting)
		return waiting
	})
	if err := producer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	got := <-done
	var lossErr *migrations.DataLossError
	if !errors.As(got.err, &lossErr) || len(got.reverted) != 0 {
		t.Fatalf("Down: reverted %v, err %v; want a DataLossError and nothing reverted", got.reverted, got.err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "outbox"}.Sanitize()).Scan(&n); err != nil || n != 1 {
		t.Fatalf("the outbox holds %d rows (err %v), want the committed event", n, err)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out waiting")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A service role that owns its migrated schema but may not create schemas
// in the database (the default for a role that does not own it) can run Up
// at start-up: with the schema there, Up does not ask to create it.
// PostgreSQL checks the privilege of CREATE SCHEMA IF NOT EXISTS before it
// looks: Up failed with "permission denied for database".
// The same for a role that may only use the schema and its tables (no
// CREATE on the schema): the version table's CREATE TABLE IF NOT EXISTS
// checked that privilege first too.
func TestUpByTheSchemasOwnerWithoutCreateOnTheDatabase(t *testing.T) {
	t.Parallel()
	for name, grant := range map[string]string{
		"owner":      `ALTER SCHEMA %s OWNER TO %s`,
		"usage only": `GRANT USAGE ON SCHEMA %s TO %s`,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			upWithoutCreate(t, grant)
		})
	}
}

func upWithoutCreate(t *testing.T, grant string) {
	ctx := context.Background()
	admin := pgtest.Pool(t)
	schema := pgtest.Schema(t)
	role := "oftest_role_" + schema[len("oftest_"):]
	ident, roleIdent := pgx.Identifier{schema}.Sanitize(), pgx.Identifier{role}.Sanitize()
	for _, stmt := range []string{
		`CREATE ROLE ` + roleIdent + ` LOGIN`,
		fmt.Sprintf(grant, ident, roleIdent),
		`GRANT ALL ON ALL TABLES IN SCHEMA ` + ident + ` TO ` + roleIdent,
	} {
		if _, err := admin.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		pgtest.DropSchema(t, schema)
		for _, stmt := range []string{`DROP OWNED BY ` + roleIdent, `DROP ROLE ` + roleIdent} {
			if _, err := admin.Exec(context.Background(), stmt); err != nil {
				t.Error(err)
			}
		}
	})
	cfg, err := pgx.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.User = role
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var mayCreate bool
	if err := conn.QueryRow(ctx, `SELECT has_database_privilege(current_database(), 'CREATE')`).Scan(&mayCreate); err != nil || mayCreate {
		t.Fatalf("the role may create schemas (%v, err %v): the test shows nothing", mayCreate, err)
	}
	if applied, err := migrations.Up(ctx, conn, schema); err != nil || len(applied) != 0 {
		t.Fatalf("Up by a role that may not create schemas: applied %v, err %v; want nothing to do", applied, err)
	}
}

// A schema migrated by a newer onceflow (a rollback of the binary) holds
// versions this one does not know. Down refuses, reverting nothing: it
// used to revert its own newest step beneath the unknown one, leaving a
// schema no binary matched. List shows the unknown versions.
func TestDownRefusesASchemaWithAVersionItDoesNotKnow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.Schema(t)
	if _, err := pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "schema_migrations"}.Sanitize()+` (version, name) VALUES (99, 'future_thing')`); err != nil {
		t.Fatal(err)
	}
	reverted, err := migrations.Down(ctx, pool, schema, 1)
	if err == nil || len(reverted) != 0 || !strings.Contains(err.Error(), "99") {
		t.Fatalf("Down: reverted %v, err %v; want a refusal naming version 99", reverted, err)
	}
	list, err := migrations.List(ctx, pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	last := list[len(list)-1]
	if len(list) != migrations.Latest()+1 || last.Version != 99 || last.Name != "future_thing" || last.AppliedAt == nil {
		t.Fatalf("List's last entry %+v of %d, want version 99 future_thing, applied", last.Migration, len(list))
	}
	for _, s := range list[:len(list)-1] {
		if s.AppliedAt == nil {
			t.Fatalf("version %d lost by the refused Down", s.Version)
		}
	}
}

// Down locks only the data tables its steps would drop: reverting a step
// that changes no table (8 changes domains) does not wait for, nor hold
// off, the transactions writing events and dedup records. It locked all
// four, so it waited behind an open consumer transaction while producers
// queued behind it, and deadlocked with one that wrote both tables.
func TestDownLocksOnlyTheTablesItWouldDrop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.EmptySchema(t)
	upTo(t, schema, checksMatchWriteVersion)
	writer, err := pgtest.Conn(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = writer.Rollback(ctx) }()
	for _, stmt := range []string{
		`INSERT INTO ` + pgx.Identifier{schema, "processed_messages"}.Sanitize() + ` (consumer, message_id) VALUES ('c', 'm')`,
		`INSERT INTO ` + pgx.Identifier{schema, "outbox"}.Sanitize() + ` (topic) VALUES ('t')`,
	} {
		if _, err := writer.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	quick, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if reverted, err := migrations.Down(quick, pool, schema, 1); err != nil || len(reverted) != 1 || reverted[0] != checksMatchWriteVersion {
		t.Fatalf("Down of the newest step beside an open writer: reverted %v, err %v", reverted, err)
	}
}

// Down waits a bounded time for a table lock it needs: behind an open
// transaction that read the outbox (a psql session) it waited with no
// timeout while every producer's insert queued behind its lock request.
// It gives up after DownConfig.LockTimeout (5 s by default), names the
// session that holds the lock and reverts nothing.
func TestDownGivesUpOnALockItCannotGet(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.Schema(t)
	openReader(t, schema)
	quick, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	start := time.Now()
	reverted, err := migrations.Down(quick, pool, schema, migrations.Latest())
	if err == nil || len(reverted) != 0 || quick.Err() != nil || !strings.Contains(err.Error(), openReaderApp) || !strings.Contains(err.Error(), "outbox") {
		t.Fatalf("Down behind an open reader: reverted %v, err %v after %s; want a failure naming the reader", reverted, err, time.Since(start))
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
		t.Errorf("Down's error %v does not wrap lock_not_available", err)
	}
	if err := migrations.Check(ctx, pool, schema); err != nil {
		t.Fatalf("the failed Down changed the schema: %v", err)
	}
}

// Reverting migrations 9 and 10 drops dead_replays and janitor_windows.
// Their rows that still matter are data as much as a dead letter (a cold
// review found `migrate down --steps 3` then `up` lost them without a
// word): a replayed event's place in its key's write order while the event
// is pending or dead (G3), and a janitor window swept within twice its
// length (G5). Down and the printed revert refuse to drop those, and drop
// the rest (a replayed event long published, a window whose janitor is
// gone) without asking.
func TestDownKeepsLiveReplayOrderAndJanitorWindows(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, table, insert string
		version             int // the step whose revert drops the table
		refused             bool
	}{
		{"a replayed event still dead", "dead_replays", `INSERT INTO outbox_dead (outbox_id, event_id, topic, created_at, error, attempts)
            VALUES (50, 'aaaaaaaa-0000-0000-0000-000000000001', 't', now(), 'refused', 2);
            INSERT INTO dead_replays (event_id, topic, first_outbox_id) VALUES ('aaaaaaaa-0000-0000-0000-000000000001', 't', 10)`, 9, true},
		{"a replayed event still pending", "dead_replays", `INSERT INTO outbox (event_id, topic) VALUES ('aaaaaaaa-0000-0000-0000-000000000001', 't');
            INSERT INTO dead_replays (event_id, topic, first_outbox_id) VALUES ('aaaaaaaa-0000-0000-0000-000000000001', 't', 10)`, 9, true},
		{"a replayed event published since", "dead_replays", `INSERT INTO dead_replays (event_id, topic, first_outbox_id)
            VALUES ('aaaaaaaa-0000-0000-0000-000000000001', 't', 10)`, 9, false},
		{"a janitor window swept lately", "janitor_windows", `INSERT INTO janitor_windows (window_seconds, seen_at) VALUES (86400, now() - interval '1 hour')`, 10, true},
		{"a janitor window whose janitor is gone", "janitor_windows", `INSERT INTO janitor_windows (window_seconds, seen_at) VALUES (60, now() - interval '1 hour')`, 10, false},
	}
	for _, c := range cases {
		for _, printed := range []bool{false, true} {
			name := c.name
			if printed {
				name += ", the printed revert"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				pool := pgtest.Pool(t)
				schema := pgtest.Schema(t)
				if _, err := pool.Exec(ctx, `SET search_path TO `+pgx.Identifier{schema}.Sanitize()+`; `+c.insert); err != nil {
					t.Fatal(err)
				}
				all, _ := migrations.All()
				steps := len(all) - c.version + 1
				var err error
				if printed {
					// The steps above the one that drops the table first,
					// then the printed revert of that one.
					if steps > 1 {
						if _, err := migrations.Down(ctx, pool, schema, steps-1); err != nil {
							t.Fatal(err)
						}
					}
					down, serr := migrations.Script(schema, c.version, true)
					if serr != nil {
						t.Fatal(serr)
					}
					_, err = pgtest.Conn(t).PgConn().Exec(ctx, down).ReadAll()
				} else {
					_, err = migrations.Down(ctx, pool, schema, steps)
				}
				switch {
				case c.refused && (err == nil || !strings.Contains(err.Error(), c.table)):
					t.Fatalf("revert of %d: err %v, want a refusal naming %s", c.version, err, c.table)
				case c.refused && !tableExists(t, schema, c.table):
					t.Fatalf("a refused revert dropped %s", c.table)
				case !c.refused && err != nil:
					t.Fatalf("revert of %d: %v, want it done (the row no longer matters)", c.version, err)
				case !c.refused && tableExists(t, schema, c.table):
					t.Fatalf("revert of %d left %s", c.version, c.table)
				}
			})
		}
	}
}
