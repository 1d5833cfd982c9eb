package migrations_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// checkDomainsVersion is the migration that moved the outbox's CHECK
// expressions into domains.
const (
	checkDomainsVersion  = 6
	strictHeadersVersion = 7
)

// upTo applies the migrations up to and including version, the way another
// tool applies `onceflow migrate print --version N`.
func upTo(t *testing.T, schema string, version int) {
	t.Helper()
	all, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range all {
		if m.Version > version {
			break
		}
		s, err := migrations.Script(schema, m.Version, false)
		if err != nil {
			t.Fatal(err)
		}
		execScript(t, s)
	}
}

// describeOutbox renders what a producer and the relay depend on in
// schema: the outbox's columns (type, nullability, default or generation
// expression), its constraints and indexes, and the schema's domains (with
// their checks) and functions, one line each, sorted, with the schema's name replaced by "S".
func describeOutbox(t *testing.T, schema string) string {
	t.Helper()
	var lines []string
	rows, err := pgtest.Pool(t).Query(context.Background(), `
SELECT 'column ' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
       || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
       || CASE a.attgenerated WHEN 's' THEN ' generated stored' ELSE '' END
       || CASE a.attidentity WHEN '' THEN '' ELSE ' identity ' || a.attidentity::text END
       || coalesce(' ' || pg_get_expr(d.adbin, d.adrelid), '')
  FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
 WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT a.attisdropped
UNION ALL
SELECT 'constraint ' || conname || ' ' || pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = $1::regclass
UNION ALL
SELECT 'index ' || pg_get_indexdef(indexrelid) FROM pg_index WHERE indrelid = $1::regclass
UNION ALL
SELECT 'domain ' || t.typname || coalesce(' ' || (SELECT string_agg(c.conname || ' ' || pg_get_constraintdef(c.oid), ', ' ORDER BY c.conname)
       FROM pg_constraint c WHERE c.contypid = t.oid), '')
  FROM pg_type t WHERE t.typnamespace = $2::regnamespace AND t.typtype = 'd'
UNION ALL
SELECT 'function ' || proname FROM pg_proc WHERE pronamespace = $2::regnamespace`,
		pgx.Identifier{schema, "outbox"}.Sanitize(), pgx.Identifier{schema}.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	var line string
	if _, err := pgx.ForEachRow(rows, []any{&line}, func() error {
		line = strings.ReplaceAll(line, pgx.Identifier{schema}.Sanitize()+".", "S.")
		lines = append(lines, strings.ReplaceAll(line, schema+".", "S."))
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

// outboxRow is what a pending event must keep across a migration.
type outboxRow struct {
	id       int64
	eventID  string
	topic    string
	key      []byte
	headers  map[string]string
	shard    int16
	keyShard int16 // computed here from the key (or the event id) the way the contract says
}

func readRows(t *testing.T, schema string) []outboxRow {
	t.Helper()
	rows, err := pgtest.Pool(t).Query(context.Background(), `SELECT id, event_id::text, uuid_send(event_id), topic, key, headers, shard FROM `+
		pgx.Identifier{schema, "outbox"}.Sanitize()+` ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	var out []outboxRow
	var r outboxRow
	var uuid []byte
	if _, err := pgx.ForEachRow(rows, []any{&r.id, &r.eventID, &uuid, &r.topic, &r.key, &r.headers, &r.shard}, func() error {
		src := r.key
		if src == nil {
			src = uuid
		}
		h := sha256.Sum256(src)
		r.keyShard = int16(h[0])
		out = append(out, r)
		r = outboxRow{}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// sameRow says whether a and b are the same pending event, shard included.
func sameRow(a, b outboxRow) bool {
	return a.id == b.id && a.eventID == b.eventID && a.topic == b.topic && string(a.key) == string(b.key) &&
		maps.Equal(a.headers, b.headers) && a.shard == b.shard
}

func insertEvents(t *testing.T, schema string) {
	t.Helper()
	if _, err := pgtest.Pool(t).Exec(context.Background(), `INSERT INTO `+pgx.Identifier{schema, "outbox"}.Sanitize()+` (topic, key, value, headers)
VALUES ('orders', 'k1', 'v', '{"a":"b"}'), ('orders', NULL, 'keyless', NULL), ('payments', '\x00ff', NULL, '{}')`); err != nil {
		t.Fatal(err)
	}
}

// Migration 6 changes how the outbox's CHECK constraints are evaluated,
// nothing else: the pending rows, their shards and their headers survive
// it and its revert, and reverting it restores version 5's schema exactly.
func TestCheckDomainsKeepRowsAndRevertToVersion5Exactly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)

	ref := pgtest.EmptySchema(t)
	upTo(t, ref, checkDomainsVersion-1)
	want := describeOutbox(t, ref)

	schema := pgtest.EmptySchema(t)
	upTo(t, schema, checkDomainsVersion-1)
	insertEvents(t, schema)
	before := readRows(t, schema)
	if len(before) != 3 {
		t.Fatalf("rows before: %+v", before)
	}
	step, err := migrations.Script(schema, checkDomainsVersion, false)
	if err != nil {
		t.Fatal(err)
	}
	execScript(t, step)
	if got := describeOutbox(t, schema); got == want {
		t.Fatal("migration 6 changed nothing in the outbox's schema")
	}
	insertEvents(t, schema) // the same rows again, under version 6's checks
	after := readRows(t, schema)
	if len(after) != 6 {
		t.Fatalf("rows after: %+v", after)
	}
	for i, r := range after {
		if r.shard != r.keyShard {
			t.Errorf("row %d: shard %d, want %d (the first byte of the key's sha256)", r.id, r.shard, r.keyShard)
		}
		if i < len(before) {
			if !sameRow(r, before[i]) {
				t.Errorf("row %d changed by the migration: %+v, was %+v", r.id, r, before[i])
			}
		}
	}

	reverted, err := migrations.Down(ctx, pool, schema, 1)
	if err != nil || len(reverted) != 1 || reverted[0] != checkDomainsVersion {
		t.Fatalf("Down: reverted %v, err %v", reverted, err)
	}
	if got := describeOutbox(t, schema); got != want {
		t.Fatalf("after reverting migration 6 the outbox is\n%s\nwant version 5's\n%s", got, want)
	}
	if got := readRows(t, schema); !slices.EqualFunc(got, after, sameRow) {
		t.Fatalf("rows after the revert: %+v, want %+v", got, after)
	}
	// And forward again, as an upgrade after a rollback would.
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		t.Fatalf("Up after the revert: %v", err)
	}
}

// A producer writing plain SQL inserts headers as text or jsonb literals
// and as any parameter pgx binds to jsonb, and a malformed topic or
// headers value is refused at INSERT with the constraint's name.
func TestPlainSQLProducersKeepTheirHeadersAndMalformedOnesAreRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.Schema(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()

	accepted := map[string]struct {
		sql  string
		args []any
	}{
		"text literal":        {`INSERT INTO ` + outbox + ` (topic, key, value, headers) VALUES ('orders', 'k1', 'v', '{"a":"b"}')`, nil},
		"jsonb literal":       {`INSERT INTO ` + outbox + ` (topic, key, value, headers) VALUES ('orders', 'k1', 'v', '{"a":"b"}'::jsonb)`, nil},
		"no headers":          {`INSERT INTO ` + outbox + ` (topic, key, value) VALUES ('orders', 'k1', 'v')`, nil},
		"empty object":        {`INSERT INTO ` + outbox + ` (topic, headers) VALUES ('orders', '{}')`, nil},
		"string parameter":    {`INSERT INTO ` + outbox + ` (topic, key, value, headers) VALUES ($1, $2, $3, $4)`, []any{"orders", []byte("k"), []byte("v"), `{"a":"b"}`}},
		"[]byte parameter":    {`INSERT INTO ` + outbox + ` (topic, key, value, headers) VALUES ($1, $2, $3, $4)`, []any{"orders", []byte("k"), []byte("v"), []byte(`{"a":"b"}`)}},
		"map parameter":       {`INSERT INTO ` + outbox + ` (topic, key, value, headers) VALUES ($1, $2, $3, $4)`, []any{"orders", []byte("k"), []byte("v"), map[string]string{"a": "b"}}},
		"nil parameter":       {`INSERT INTO ` + outbox + ` (topic, key, value, headers) VALUES ($1, $2, $3, $4)`, []any{"orders", nil, nil, nil}},
		"249-character topic": {`INSERT INTO ` + outbox + ` (topic) VALUES (repeat('t', 249))`, nil},
	}
	for name, c := range accepted {
		if _, err := pool.Exec(ctx, c.sql, c.args...); err != nil {
			t.Errorf("%s: refused: %v", name, err)
		}
	}

	refused := map[string]struct {
		sql        string
		constraint string
	}{
		"number value":       {`INSERT INTO ` + outbox + ` (topic, headers) VALUES ('orders', '{"a":1}')`, "outbox_headers_check"},
		"nested object":      {`INSERT INTO ` + outbox + ` (topic, headers) VALUES ('orders', '{"a":{"b":"c"}}')`, "outbox_headers_check"},
		"one bad among good": {`INSERT INTO ` + outbox + ` (topic, headers) VALUES ('orders', '{"a":"b","c":null}')`, "outbox_headers_check"},
		"array":              {`INSERT INTO ` + outbox + ` (topic, headers) VALUES ('orders', '["a"]')`, "outbox_headers_check"},
		// A lax path unwraps arrays: these passed before migration 7, and
		// the relay published the event's headers as one bad-headers header.
		"array of strings value": {`INSERT INTO ` + outbox + ` (topic, headers) VALUES ('orders', '{"type":"created","tags":["a"]}')`, "outbox_headers_check"},
		"empty array value":      {`INSERT INTO ` + outbox + ` (topic, headers) VALUES ('orders', '{"a":[]}')`, "outbox_headers_check"},
		"two strings array":      {`INSERT INTO ` + outbox + ` (topic, headers) VALUES ('orders', '{"a":["x","y"]}')`, "outbox_headers_check"},
		"JSON null":              {`INSERT INTO ` + outbox + ` (topic, headers) VALUES ('orders', 'null')`, "outbox_headers_check"},
		"string":                 {`INSERT INTO ` + outbox + ` (topic, headers) VALUES ('orders', '"a"')`, "outbox_headers_check"},
		"empty topic":            {`INSERT INTO ` + outbox + ` (topic) VALUES ('')`, "outbox_topic_check"},
		"250-character topic":    {`INSERT INTO ` + outbox + ` (topic) VALUES (repeat('t', 250))`, "outbox_topic_check"},
		"bad row in a batch":     {`INSERT INTO ` + outbox + ` (topic, headers) VALUES ('orders', '{"a":"b"}'), ('orders', '{"a":2}')`, "outbox_headers_check"},
		"replayed dead row":      {`INSERT INTO ` + outbox + ` (topic, headers) SELECT 'orders', '{"a":true}'::jsonb`, "outbox_headers_check"},
	}
	for name, c := range refused {
		_, err := pool.Exec(ctx, c.sql)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "23514" || pgErr.ConstraintName != c.constraint {
			t.Errorf("%s: got %v, want a check violation of %s", name, err, c.constraint)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+outbox).Scan(&n); err != nil || n != len(accepted) {
		t.Fatalf("outbox holds %d rows (err %v), want the %d accepted", n, err, len(accepted))
	}
}

// Migration 7 only makes the headers domain's check strict, and its revert
// restores version 6's check exactly.
func TestStrictHeadersRevertToVersion6Exactly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	check := func(schema string) string {
		t.Helper()
		var def string
		if err := pool.QueryRow(ctx, `SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c
JOIN pg_type ty ON ty.oid = c.contypid JOIN pg_namespace n ON n.oid = ty.typnamespace
WHERE n.nspname = $1 AND ty.typname = 'outbox_headers'`, schema).Scan(&def); err != nil {
			t.Fatal(err)
		}
		return def
	}
	ref := pgtest.EmptySchema(t)
	upTo(t, ref, strictHeadersVersion-1)
	schema := pgtest.EmptySchema(t)
	upTo(t, schema, strictHeadersVersion)
	if check(schema) == check(ref) {
		t.Fatal("migration 7 left the headers check as it was")
	}
	if reverted, err := migrations.Down(ctx, pool, schema, 1); err != nil || !slices.Equal(reverted, []int{strictHeadersVersion}) {
		t.Fatalf("Down: reverted %v, err %v", reverted, err)
	}
	if got, want := check(schema), check(ref); got != want {
		t.Fatalf("after reverting migration 7 the headers check is\n%s\nwant version 6's\n%s", got, want)
	}
}

// Rows that version 6's lax check let through (a header whose value is an
// array) are rewritten by migration 7 into the one header the relay
// publishes for headers it cannot read, "onceflow-bad-headers", holding
// the JSON: PostgreSQL checks a table's CHECK again on every UPDATE, so
// left as they were they failed the relay's own updates (its failure and
// crash charges: a relay that died with one in flight stopped every other
// relay's start), and a dead one could not be replayed.
func TestStrictHeadersRewriteTheRowsTheLaxCheckLetThrough(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.EmptySchema(t)
	upTo(t, schema, strictHeadersVersion-1)
	outbox, dead := pgx.Identifier{schema, "outbox"}.Sanitize(), pgx.Identifier{schema, "outbox_dead"}.Sanitize()
	for _, stmt := range []string{
		`INSERT INTO ` + outbox + ` (topic, headers) VALUES ('t', '{"type":"created","tags":["a"]}'), ('t', '{"a":"b"}'), ('t', NULL)`,
		`INSERT INTO ` + dead + ` (outbox_id, event_id, topic, headers, created_at, error, attempts) VALUES (1, gen_random_uuid(), 't', '{"a":[]}', now(), 'x', 1)`,
	} {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	rows, _ := pool.Query(ctx, `SELECT coalesce(headers::text, 'NULL') FROM `+outbox+` ORDER BY id`)
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := []string{`{"onceflow-bad-headers": "{\"tags\": [\"a\"], \"type\": \"created\"}"}`, `{"a": "b"}`, `NULL`}
	if !slices.Equal(got, want) {
		t.Fatalf("outbox headers after migration 7:\n got %q\nwant %q", got, want)
	}
	// The relay's updates of those rows, and a replay of the dead one.
	if _, err := pool.Exec(ctx, `UPDATE `+outbox+` SET attempts = attempts + 1`); err != nil {
		t.Fatalf("an update of the pending rows: %v", err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, headers) SELECT topic, headers FROM `+dead); err != nil {
		t.Fatalf("a replay of the dead row: %v", err)
	}
}
