package main

import (
	"context"
	"errors"
	"io"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/internal/proctest"
	"github.com/onceflow/onceflow/migrations"
)

// migrate down refuses to drop an outbox holding pending events unless
// --force.
func TestMigrateDownRefusesPendingEventsWithoutForce(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	flags := []string{"--database-url", pgtest.URL(t), "--schema", schema}
	if _, err := pgtest.Pool(t).Exec(context.Background(), `INSERT INTO `+pgx.Identifier{schema, "outbox"}.Sanitize()+` (topic, value) VALUES ('t', 'pending')`); err != nil {
		t.Fatal(err)
	}
	all := strconv.Itoa(migrations.Latest()) // down to 0001, which drops the outbox
	out, err := runCLI(t, append([]string{"migrate", "down", "--steps", all}, flags...)...)
	if err == nil || !strings.Contains(err.Error(), "outbox") || !strings.Contains(err.Error(), "--force") {
		t.Fatalf("down --steps %s: %v\n%s", all, err, out)
	}
	if count(t, schema, "outbox") != 1 {
		t.Fatal("the pending event is gone")
	}
	if out, err = runCLI(t, append([]string{"migrate", "down", "--steps", all, "--force"}, flags...)...); err != nil || !strings.Contains(out, "reverted 0001") {
		t.Fatalf("down --force: %v\n%s", err, out)
	}
}

// migrate down on a schema that was never migrated creates nothing.
func TestMigrateDownOnANeverMigratedSchemaCreatesNothing(t *testing.T) {
	t.Parallel()
	schema := pgtest.EmptySchema(t)
	out, err := runCLI(t, "migrate", "down", "--database-url", pgtest.URL(t), "--schema", schema)
	if err != nil || !strings.Contains(out, "nothing to revert") {
		t.Fatalf("down: %v\n%s", err, out)
	}
	var exists bool
	if err := pgtest.Pool(t).QueryRow(context.Background(), `SELECT to_regnamespace($1) IS NOT NULL`, pgx.Identifier{schema}.Sanitize()).Scan(&exists); err != nil || exists {
		t.Fatalf("schema %s exists after down (err %v)", schema, err)
	}
}

// migrate print needs no database; its output, applied by another tool,
// leaves `migrate up` nothing to do and a relay that starts.
func TestMigratePrintAppliedByAnotherTool(t *testing.T) {
	t.Parallel()
	schema := pgtest.EmptySchema(t)
	script, err := runCLI(t, "migrate", "print", "--schema", schema)
	if err != nil {
		t.Fatalf("print: %v\n%s", err, script)
	}
	conn := pgtest.Conn(t)
	if _, err := conn.PgConn().Exec(context.Background(), script).ReadAll(); err != nil {
		t.Fatalf("apply the printed script: %v", err)
	}
	flags := []string{"--database-url", pgtest.URL(t), "--schema", schema}
	if out, err := runCLI(t, append([]string{"migrate", "up"}, flags...)...); err != nil || !strings.Contains(out, "up to date") {
		t.Fatalf("up after the printed script: %v\n%s", err, out)
	}
	if err := migrations.Check(context.Background(), pgtest.Pool(t), schema); err != nil {
		t.Fatalf("the relay's schema check: %v", err)
	}
	// The relay starts on it.
	k := kafkatest.New(t)
	ctx, cancel := context.WithCancel(context.Background())
	logs := &proctest.Buffer{}
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, append([]string{"relay", "--brokers", strings.Join(k.Brokers, ","), "--lease-duration", "2s"}, flags...), io.Discard, logs)
	}()
	waitUntil(t, "the relay to start", time.Minute, func() bool { return strings.Contains(logs.String(), "relay started") })
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("relay: %v\n%s", err, logs)
	}
	one, err := runCLI(t, "migrate", "print", "--schema", schema, "--version", "1")
	if err != nil || !strings.Contains(one, "INSERT INTO schema_migrations") || strings.Contains(one, "idempotency_keys") {
		t.Fatalf("print --version 1: %v\n%s", err, one)
	}
	down, err := runCLI(t, "migrate", "print", "--schema", schema, "--version", "2", "--down")
	if err != nil || !strings.Contains(down, "DROP TABLE IF EXISTS idempotency_keys") || !strings.Contains(down, "DELETE FROM schema_migrations") {
		t.Fatalf("print --version 2 --down: %v\n%s", err, down)
	}
	if _, err := runCLI(t, "migrate", "print", "--version", "99"); !errors.Is(err, errUsage) {
		t.Fatalf("print --version 99: err %v, want a usage error", err)
	}
}

// migrate down that will refuse anyway (the outbox holds an event) does
// not first queue for the outbox's ACCESS EXCLUSIVE lock: behind an open
// transaction that read the outbox (a psql session), it waited with no
// timeout, and every producer's INSERT queued behind it, so business
// transactions stopped. An empty outbox it must lock to be sure of waits
// at most --lock-timeout, then fails naming the session that holds it.
func TestMigrateDownDoesNotStopProducersBehindAnOpenReader(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.Schema(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	flags := []string{"--database-url", pgtest.URL(t), "--schema", schema}
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, value) VALUES ('t', 'pending')`); err != nil {
		t.Fatal(err)
	}
	readerConn := pgtest.Conn(t)
	if _, err := readerConn.Exec(ctx, `SET application_name = 'oftest-open-reader'`); err != nil {
		t.Fatal(err)
	}
	reader, err := readerConn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = reader.Rollback(ctx) }()
	var n int
	if err := reader.QueryRow(ctx, `SELECT count(*) FROM `+outbox).Scan(&n); err != nil {
		t.Fatal(err)
	}
	all := strconv.Itoa(migrations.Latest())
	type result struct {
		out string
		err error
	}
	down := func(extra ...string) <-chan result {
		done := make(chan result, 1)
		go func() {
			out, err := runCLI(t, append(append([]string{"migrate", "down", "--steps", all}, extra...), flags...)...)
			done <- result{out, err}
		}()
		return done
	}
	done := down()
	var got *result
	waitUntil(t, "migrate down to finish or wait for the outbox's lock", 10*time.Second, func() bool {
		select {
		case r := <-done:
			got = &r
			return true
		default:
		}
		var waiting bool
		_ = pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE NOT granted AND relation = to_regclass($1))`, outbox).Scan(&waiting)
		return waiting
	})
	time.Sleep(time.Second) // as long as a producer's transaction may take
	quick, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, insertErr := pool.Exec(quick, `INSERT INTO `+outbox+` (topic, value) VALUES ('t', 'business as usual')`)
	cancel()
	if insertErr != nil {
		t.Errorf("a producer's insert while migrate down ran: %v", insertErr)
	}
	if got == nil {
		_ = reader.Rollback(ctx)
		r := <-done
		got = &r
	}
	if got.err == nil || !strings.Contains(got.err.Error(), "outbox") || !strings.Contains(got.err.Error(), "--force") {
		t.Fatalf("down --steps %s of an outbox holding an event: %v\n%s", all, got.err, got.out)
	}
	if t.Failed() {
		return
	}

	// Empty, the outbox is locked to be sure no event commits into it
	// while it is dropped: the open reader makes that wait, for at most
	// --lock-timeout.
	if _, err := pool.Exec(ctx, `DELETE FROM `+outbox); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	r := <-down("--lock-timeout", "300ms")
	if r.err == nil || !strings.Contains(r.err.Error(), "oftest-open-reader") || !strings.Contains(r.err.Error(), "outbox") ||
		!strings.Contains(r.err.Error(), "--lock-timeout") {
		t.Fatalf("down --lock-timeout 300ms behind an open reader: %v, want a failure naming the reader's session\n%s", r.err, r.out)
	}
	if waited := time.Since(start); waited > 5*time.Second {
		t.Errorf("down took %s to give up with --lock-timeout 300ms", waited)
	}
	if err := migrations.Check(ctx, pool, schema); err != nil {
		t.Fatalf("the failed down changed the schema: %v", err)
	}
	for _, bad := range []string{"0", "720h"} { // 720h: past PostgreSQL's lock_timeout limit
		if _, err := runCLI(t, append([]string{"migrate", "down", "--lock-timeout", bad}, flags...)...); !errors.Is(err, errUsage) {
			t.Errorf("--lock-timeout %s: err %v, want a usage error", bad, err)
		}
	}
}

// migrate print --down prints a revert that refuses to drop tables holding
// rows, as migrate down does; --force prints one that drops them.
func TestMigratePrintDownRefusesUnlessForced(t *testing.T) {
	t.Parallel()
	down, err := runCLI(t, "migrate", "print", "--version", "1", "--down")
	if err != nil || !strings.Contains(down, "refusing to revert migration 1") || !strings.Contains(down, "LOCK TABLE") {
		t.Fatalf("print --version 1 --down: %v\n%s", err, down)
	}
	forced, err := runCLI(t, "migrate", "print", "--version", "1", "--down", "--force")
	if err != nil || strings.Contains(forced, "refusing") || !strings.Contains(forced, "DROP TABLE IF EXISTS outbox;") || !strings.Contains(forced, "--force") {
		t.Fatalf("print --version 1 --down --force: %v\n%s", err, forced)
	}
	if _, err := runCLI(t, "migrate", "print", "--version", "1", "--force"); !errors.Is(err, errUsage) {
		t.Fatalf("print --force without --down: err %v, want a usage error", err)
	}
}

// migrate up (an upgrade: migrations 6 on pending) behind an open
// transaction that read the outbox (a psql session) waited for the
// outbox's ACCESS EXCLUSIVE lock with no bound, and every producer's
// INSERT queued behind it: business transactions stopped for as long as
// the reader stayed. It waits at most --lock-timeout (default 5s, as
// migrate down), then fails (exit 1) naming the session that holds the
// table, having applied nothing.
func TestMigrateUpDoesNotStopProducersBehindAnOpenReader(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.Schema(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	flags := []string{"--database-url", pgtest.URL(t), "--schema", schema}
	// The schema as the previous release left it: up to migration 5.
	if _, err := migrations.DownForce(ctx, pool, schema, migrations.Latest()-5); err != nil {
		t.Fatal(err)
	}
	readerConn := pgtest.Conn(t)
	if _, err := readerConn.Exec(ctx, `SET application_name = 'oftest-open-reader'`); err != nil {
		t.Fatal(err)
	}
	reader, err := readerConn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = reader.Rollback(ctx) }()
	var n int
	if err := reader.QueryRow(ctx, `SELECT count(*) FROM `+outbox).Scan(&n); err != nil {
		t.Fatal(err)
	}
	type result struct {
		out string
		err error
	}
	up := func(extra ...string) <-chan result {
		done := make(chan result, 1)
		go func() {
			out, err := runCLITimeout(t, 30*time.Second, append(append([]string{"migrate", "up"}, extra...), flags...)...)
			done <- result{out, err}
		}()
		return done
	}
	assertFailedNamingTheReader := func(what string, r result, waited, atMost time.Duration) {
		t.Helper()
		if r.err == nil || errors.Is(r.err, errUsage) || errors.Is(r.err, context.DeadlineExceeded) ||
			!strings.Contains(r.err.Error(), "oftest-open-reader") || !strings.Contains(r.err.Error(), "outbox") ||
			!strings.Contains(r.err.Error(), "migrate up --lock-timeout") {
			t.Fatalf("%s behind an open reader: %v after %s, want a failure (exit 1) naming the reader's session\n%s", what, r.err, waited.Round(time.Millisecond), r.out)
		}
		if waited > atMost {
			t.Errorf("%s took %s to give up", what, waited.Round(time.Millisecond))
		}
		if err := migrations.Check(ctx, pool, schema); err == nil || !strings.HasPrefix(err.(*migrations.MissingError).Missing[0].Name, "outbox_check_domains") {
			t.Fatalf("after the failed %s: %v, want migrations 6 on still missing", what, err)
		}
	}

	// --lock-timeout 1s: a producer's insert waits at most that long.
	start := time.Now()
	done := up("--lock-timeout", "1s")
	var early *result
	waitUntil(t, "migrate up to end or wait for the outbox's lock", 10*time.Second, func() bool {
		select {
		case r := <-done:
			early = &r
			return true
		default:
		}
		var waiting bool
		_ = pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE NOT granted AND relation = to_regclass($1))`, outbox).Scan(&waiting)
		return waiting
	})
	quick, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, insertErr := pool.Exec(quick, `INSERT INTO `+outbox+` (topic, value) VALUES ('t', 'business as usual')`)
	cancel()
	if insertErr != nil {
		t.Errorf("a producer's insert while migrate up --lock-timeout 1s waited behind an open reader: %v", insertErr)
	}
	if early == nil {
		r := <-done
		early = &r
	}
	assertFailedNamingTheReader("migrate up --lock-timeout 1s", *early, time.Since(start), 5*time.Second)
	// The producer, granted its lock as migrate up gave up, did not hold
	// it up: naming it would point the operator at the wrong session.
	if strings.Contains(early.err.Error(), "business as usual") {
		t.Errorf("migrate up's failure names the producer queued behind it as a holder: %v", early.err)
	}

	// The default is migrate down's: 5s.
	start = time.Now()
	assertFailedNamingTheReader("migrate up", <-up(), time.Since(start), 12*time.Second)

	for _, bad := range []string{"0", "720h"} { // 720h: past PostgreSQL's lock_timeout limit
		if _, err := runCLI(t, append([]string{"migrate", "up", "--lock-timeout", bad}, flags...)...); !errors.Is(err, errUsage) {
			t.Errorf("migrate up --lock-timeout %s: err %v, want a usage error", bad, err)
		}
	}

	// The reader gone, the upgrade goes through, with a URL that sets a
	// lock_timeout of its own, as docs/operations.md used to advise.
	if err := reader.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("lock_timeout", "2s")
	u.RawQuery = q.Encode()
	out, err := runCLI(t, "migrate", "up", "--database-url", u.String(), "--schema", schema)
	if err != nil || !strings.Contains(out, "applied 0006") {
		t.Fatalf("migrate up with ?lock_timeout=2s in the URL: %v\n%s", err, out)
	}
	if err := migrations.Check(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
}

// ONCEFLOW_MIGRATE_LOCK_TIMEOUT sets migrate up's --lock-timeout, as it
// does migrate down's.
func TestMigrateUpLockTimeoutFromTheEnvironment(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.Schema(t)
	if _, err := migrations.DownForce(ctx, pool, schema, migrations.Latest()-5); err != nil {
		t.Fatal(err)
	}
	reader, err := pgtest.Conn(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = reader.Rollback(ctx) }()
	if _, err := reader.Exec(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "outbox"}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	flags := []string{"--database-url", pgtest.URL(t), "--schema", schema}
	t.Setenv("ONCEFLOW_MIGRATE_LOCK_TIMEOUT", "300ms")
	start := time.Now()
	out, err := runCLITimeout(t, 30*time.Second, append([]string{"migrate", "up"}, flags...)...)
	if waited := time.Since(start); err == nil || !strings.Contains(err.Error(), "gave up after 300ms") || waited > 4*time.Second {
		t.Fatalf("migrate up with ONCEFLOW_MIGRATE_LOCK_TIMEOUT=300ms behind an open reader: %v after %s\n%s", err, waited, out)
	}
	t.Setenv("ONCEFLOW_MIGRATE_LOCK_TIMEOUT", "0")
	if _, err := runCLI(t, append([]string{"migrate", "up"}, flags...)...); !errors.Is(err, errUsage) {
		t.Errorf("migrate up with ONCEFLOW_MIGRATE_LOCK_TIMEOUT=0: err %v, want a usage error", err)
	}
}

// A schema whose tables another tool applied from the bare files has no
// version table. The advice migrate up and the relay gave for it (apply
// `onceflow migrate print` output, or run `onceflow migrate up`) failed
// both ways: relation "outbox" already exists. migrate up refuses it,
// changing nothing, with SQL that records the versions applied, and
// after that SQL applies the rest.
func TestMigrateUpOnHandAppliedTablesSaysHowToRecordThem(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := pgtest.EmptySchema(t)
	ident := pgx.Identifier{schema}.Sanitize()
	all, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	conn := pgtest.Conn(t)
	if _, err := conn.Exec(ctx, `CREATE SCHEMA `+ident+`; SET search_path TO `+ident+`, public`); err != nil {
		t.Fatal(err)
	}
	for _, m := range all[:3] {
		if _, err := conn.Exec(ctx, m.Up); err != nil {
			t.Fatal(err)
		}
	}
	flags := []string{"--database-url", pgtest.URL(t), "--schema", schema}
	out, err := runCLI(t, append([]string{"migrate", "up"}, flags...)...)
	if err == nil || errors.Is(err, errUsage) || strings.Contains(err.Error(), "already exists") || !strings.Contains(err.Error(), "<N>") {
		t.Fatalf("migrate up on hand-applied tables: %v, want a failure (exit 1) with SQL that records them\n%s", err, out)
	}
	// The SQL between backquotes, as an operator would copy it.
	var record string
	for i, part := range strings.Split(err.Error(), "`") {
		if i%2 == 1 && strings.HasPrefix(part, "BEGIN; CREATE TABLE") {
			record = strings.ReplaceAll(part, "<N>", "3")
		}
	}
	if _, err := pgtest.Conn(t).Exec(ctx, record); err != nil {
		t.Fatalf("the advised SQL %q: %v", record, err)
	}
	out, err = runCLI(t, append([]string{"migrate", "up"}, flags...)...)
	if err != nil || strings.Contains(out, "applied 0003") || !strings.Contains(out, "applied 0004") {
		t.Fatalf("migrate up after the advised SQL: %v\n%s", err, out)
	}
}
