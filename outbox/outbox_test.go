package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
)

type row struct {
	id       int64
	eventID  string
	topic    string
	key      []byte
	value    []byte
	headers  map[string]string
	shard    int16
	attempts int
}

func readOutbox(t *testing.T, db *pgxpool.Pool, schema string) []row {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT id, event_id::text, topic, key, value, headers, shard, attempts FROM `+
		pgx.Identifier{schema, "outbox"}.Sanitize()+` ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	var out []row
	for rows.Next() {
		var r row
		if err := rows.Scan(&r.id, &r.eventID, &r.topic, &r.key, &r.value, &r.headers, &r.shard, &r.attempts); err != nil {
			t.Fatal(err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestWriteKeepsOrderAndFields(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	db := pgtest.Pool(t)
	w, err := outbox.NewWriter(&outbox.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	chosen := outbox.NewID()
	msgs := []outbox.Message{
		{Topic: "orders", Key: []byte("k1"), Value: []byte("v1"), Headers: map[string]string{"type": "created"}},
		{Topic: "orders", Key: []byte("k1"), Value: []byte("v2"), ID: chosen},
		{Topic: "payments", Value: []byte("v3")},
		{Topic: "orders", Key: []byte("k2")},
	}
	if err := w.Write(context.Background(), db, msgs...); err != nil {
		t.Fatal(err)
	}
	got := readOutbox(t, db, schema)
	if len(got) != len(msgs) {
		t.Fatalf("got %d rows, want %d", len(got), len(msgs))
	}
	for i, r := range got {
		m := msgs[i]
		if r.topic != m.Topic || string(r.key) != string(m.Key) || string(r.value) != string(m.Value) {
			t.Errorf("row %d = %+v, want %+v", i, r, m)
		}
		if (r.key == nil) != (m.Key == nil) || (r.value == nil) != (m.Value == nil) {
			t.Errorf("row %d: null key/value not kept: %+v", i, r)
		}
		if i > 0 && r.id <= got[i-1].id {
			t.Errorf("ids not increasing: %d after %d", r.id, got[i-1].id)
		}
		if len(r.eventID) != 36 {
			t.Errorf("row %d: event_id %q is not a UUID", i, r.eventID)
		}
		if r.attempts != 0 {
			t.Errorf("row %d: attempts %d", i, r.attempts)
		}
	}
	if got[1].eventID != chosen {
		t.Errorf("chosen id: got %s want %s", got[1].eventID, chosen)
	}
	if got[0].headers["type"] != "created" || got[1].headers != nil {
		t.Errorf("headers: %v, %v", got[0].headers, got[1].headers)
	}
	if got[0].shard != got[1].shard {
		t.Errorf("same key, different shards: %d, %d", got[0].shard, got[1].shard)
	}
	if got[0].eventID == got[2].eventID {
		t.Error("generated event ids repeat")
	}
}

// G1: the event exists if and only if its transaction commits.
func TestWriteFollowsTransaction(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	db := pgtest.Pool(t)
	w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
	ctx := context.Background()
	boom := errors.New("business change failed")
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if err := w.Write(ctx, tx, outbox.Message{Topic: "t", Value: []byte("rolled back")}); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("BeginFunc: %v", err)
	}
	if got := readOutbox(t, db, schema); len(got) != 0 {
		t.Fatalf("rolled-back event is in the outbox: %+v", got)
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		return w.Write(ctx, tx, outbox.Message{Topic: "t", Value: []byte("committed")})
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := readOutbox(t, db, schema); len(got) != 1 || string(got[0].value) != "committed" {
		t.Fatalf("after commit: %+v", got)
	}
}

type countingTracer struct{ queries atomic.Int64 }

func (c *countingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.queries.Add(1)
	return ctx
}
func (c *countingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func TestWriteManyIsOneStatement(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	cfg, err := pgx.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	tracer := &countingTracer{}
	cfg.Tracer = tracer
	conn, err := pgx.ConnectConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
	msgs := make([]outbox.Message, 500)
	for i := range msgs {
		msgs[i] = outbox.Message{Topic: "t", Key: []byte{byte(i)}, Value: []byte("x")}
	}
	before := tracer.queries.Load()
	if err := w.Write(context.Background(), conn, msgs...); err != nil {
		t.Fatal(err)
	}
	if n := tracer.queries.Load() - before; n != 1 {
		t.Fatalf("Write of 500 messages ran %d statements, want 1", n)
	}
	if got := readOutbox(t, pgtest.Pool(t), schema); len(got) != 500 {
		t.Fatalf("got %d rows", len(got))
	}
}

// The outbox write takes no cluster-wide lock: a commit that issued NOTIFY
// holds PostgreSQL's notify lock through its WAL flush, so every notifying
// commit in the cluster queues behind the others (business transactions at
// 16 writers ran at 0.43x a plain table). No trigger runs on the outbox; the
// relay finds new events by probing (see relay.Config.ProbeInterval).
func TestOutboxWriteFiresNoTrigger(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	rows, _ := pgtest.Pool(t).Query(context.Background(), `SELECT tgname FROM pg_trigger
WHERE tgrelid = $1::regclass AND NOT tgisinternal`, pgx.Identifier{schema, "outbox"}.Sanitize())
	triggers, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(triggers) != 0 {
		t.Fatalf("outbox has triggers %v: the write path must not NOTIFY", triggers)
	}
}

// The plain-SQL form README and the package doc give keeps a JSON value
// byte for byte. Their first form gave key and value as text literals,
// which bytea reads in its escape format: a JSON "\\" lost a backslash,
// a JSON \" was refused, and the key '\x6b32' became "k2" (helper 79).
func TestPlainSQLInsert(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	db := pgtest.Pool(t)
	table := pgx.Identifier{schema, "outbox"}.Sanitize()
	const key, value = `\x6b32`, `{"path":"C:\\temp","say":"\"hi\"\n\u00e9"}`
	_, err := db.Exec(context.Background(), `INSERT INTO `+table+` (topic, key, value, headers) VALUES ('orders', convert_to('`+key+`', 'UTF8'), convert_to('`+value+`', 'UTF8'), '{"a":"b"}')`)
	if err != nil {
		t.Fatalf("plain SQL insert: %v", err)
	}
	// The same through parameters, text on the wire.
	_, err = db.Exec(context.Background(), `INSERT INTO `+table+` (topic, key, value, headers) VALUES ('orders', convert_to($1, 'UTF8'), convert_to($2, 'UTF8'), $3)`,
		key, value, `{"a":"b"}`)
	if err != nil {
		t.Fatalf("plain SQL insert with parameters: %v", err)
	}
	got := readOutbox(t, db, schema)
	if len(got) != 2 {
		t.Fatalf("got %+v", got)
	}
	for _, r := range got {
		if string(r.key) != key || string(r.value) != value || r.headers["a"] != "b" || len(r.eventID) != 36 {
			t.Fatalf("stored key %q value %q headers %v, want key %q value %q", r.key, r.value, r.headers, key, value)
		}
	}
	// Header values must be strings: Kafka headers are bytes, and a number
	// would be ambiguous.
	_, err = db.Exec(context.Background(), `INSERT INTO `+table+` (topic, headers) VALUES ('orders', '{"a":1}')`)
	if err == nil {
		t.Fatal("non-string header value was accepted")
	}
	// README: SQL NULL is "no headers"; the JSON null is refused.
	if _, err = db.Exec(context.Background(), `INSERT INTO `+table+` (topic, headers) VALUES ('orders', NULL)`); err != nil {
		t.Fatalf("SQL NULL headers: %v", err)
	}
	if _, err = db.Exec(context.Background(), `INSERT INTO `+table+` (topic, headers) VALUES ('orders', 'null')`); err == nil {
		t.Fatal("JSON null headers were accepted")
	}
}

func TestWriteRejectsBadMessages(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	db := pgtest.Pool(t)
	w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
	cases := map[string]outbox.Message{
		"empty topic":     {},
		"bad topic":       {Topic: "a topic"},
		"long topic":      {Topic: string(make([]byte, 250))},
		"bad id":          {Topic: "t", ID: "42"},
		"reserved header": {Topic: "t", Headers: map[string]string{"message-id": "x"}},
		// The headers are stored as jsonb: text without NUL. Bytes that
		// are not UTF-8 were replaced by U+FFFD (a signature lost
		// silently), and a NUL failed in PostgreSQL with SQLSTATE 22P05.
		"binary header value": {Topic: "t", Headers: map[string]string{"sig": "\xca\xfe\xba\xbe"}},
		"binary header name":  {Topic: "t", Headers: map[string]string{"k\xff": "v"}},
		"NUL in a value":      {Topic: "t", Headers: map[string]string{"k": "a\x00b"}},
		"NUL in a name":       {Topic: "t", Headers: map[string]string{"a\x00": "v"}},
		// An unset uuid.UUID{} formats to the nil UUID: every event would
		// share it, and consumers would keep only the first.
		"nil id": {Topic: "t", ID: "00000000-0000-0000-0000-000000000000"},
	}
	for name, m := range cases {
		err := w.Write(context.Background(), db, outbox.Message{Topic: "ok"}, m)
		if !errors.Is(err, outbox.ErrInvalidMessage) {
			t.Errorf("%s: err = %v, want ErrInvalidMessage", name, err)
		}
	}
	if got := readOutbox(t, db, schema); len(got) != 0 {
		t.Fatalf("a rejected call wrote rows: %+v", got)
	}
	if _, err := outbox.NewWriter(&outbox.Config{Schema: string(make([]byte, 64))}); err == nil {
		t.Error("NewWriter accepted a 64-byte schema name")
	}
}

// ctxHeaders is an Injector copying the headers stored in ctx.
type ctxHeaders struct{}

type headersKey struct{}

func (ctxHeaders) InjectHeaders(ctx context.Context, h map[string]string) {
	for k, v := range ctx.Value(headersKey{}).(map[string]string) {
		h[k] = v
	}
}

func TestInjectorAddsContextHeadersWithoutOverridingTheMessages(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	db := pgtest.Pool(t)
	w, err := outbox.NewWriter(&outbox.Config{Schema: schema, Inject: ctxHeaders{}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.WithValue(context.Background(), headersKey{}, map[string]string{
		"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"tracestate":  "vendor=1",
		"message-id":  "not-an-id", // reserved: ignored
	})
	own := map[string]string{"tracestate": "mine", "type": "created"}
	if err := w.Write(ctx, db,
		outbox.Message{Topic: "orders", Value: []byte("v1"), Headers: own},
		outbox.Message{Topic: "orders", Value: []byte("v2")},
	); err != nil {
		t.Fatal(err)
	}
	if len(own) != 2 {
		t.Errorf("the message's own headers were changed: %v", own)
	}
	got := readOutbox(t, db, schema)
	if len(got) != 2 {
		t.Fatalf("got %d rows, want 2", len(got))
	}
	want := []map[string]string{
		{"tracestate": "mine", "type": "created"}, // the trace context is one unit: see TestInjectedTraceContextIsOneUnit
		{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "vendor=1"},
	}
	for i, r := range got {
		if len(r.headers) != len(want[i]) {
			t.Errorf("row %d headers = %v, want %v", i, r.headers, want[i])
			continue
		}
		for k, v := range want[i] {
			if r.headers[k] != v {
				t.Errorf("row %d header %q = %q, want %q", i, k, r.headers[k], v)
			}
		}
	}
}

// traceparent and tracestate are one unit, and baggage goes with them: a
// message that forwards a trace context of its own (an upstream's) got
// the request's tracestate and baggage merged in header by header, so
// consumers saw the upstream trace carrying another trace's vendor state
// and the request's baggage. A message setting either header now gets
// none of the injected three; one setting only baggage keeps its baggage
// and still joins the request's trace; other injected headers still fill
// in one by one.
func TestInjectedTraceContextIsOneUnit(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	db := pgtest.Pool(t)
	w, err := outbox.NewWriter(&outbox.Config{Schema: schema, Inject: ctxHeaders{}})
	if err != nil {
		t.Fatal(err)
	}
	const reqTP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	const upTP = "00-22222222222222222222222222222222-2222222222222222-01"
	ctx := context.WithValue(context.Background(), headersKey{}, map[string]string{
		"traceparent": reqTP, "tracestate": "vendor=request", "baggage": "tenant=request", "x-other": "injected",
	})
	cases := []struct {
		own, want map[string]string
	}{
		{own: map[string]string{"traceparent": upTP},
			want: map[string]string{"traceparent": upTP, "x-other": "injected"}},
		{own: map[string]string{"tracestate": "vendor=mine"},
			want: map[string]string{"tracestate": "vendor=mine", "x-other": "injected"}},
		{own: map[string]string{"traceparent": upTP, "baggage": "tenant=upstream"},
			want: map[string]string{"traceparent": upTP, "baggage": "tenant=upstream", "x-other": "injected"}},
		{own: map[string]string{"baggage": "tenant=mine"},
			want: map[string]string{"traceparent": reqTP, "tracestate": "vendor=request", "baggage": "tenant=mine", "x-other": "injected"}},
		{own: map[string]string{"x-other": "mine"},
			want: map[string]string{"traceparent": reqTP, "tracestate": "vendor=request", "baggage": "tenant=request", "x-other": "mine"}},
	}
	var msgs []outbox.Message
	for _, c := range cases {
		msgs = append(msgs, outbox.Message{Topic: "orders", Value: []byte("v"), Headers: c.own})
	}
	if err := w.Write(ctx, db, msgs...); err != nil {
		t.Fatal(err)
	}
	got := readOutbox(t, db, schema)
	if len(got) != len(cases) {
		t.Fatalf("got %d rows, want %d", len(got), len(cases))
	}
	for i, r := range got {
		if fmt.Sprint(r.headers) != fmt.Sprint(cases[i].want) {
			t.Errorf("message with own headers %v stored %v; want %v", cases[i].own, r.headers, cases[i].want)
		}
	}
}

// Consumers deduplicate on the message id, so a call writing one id twice
// to one topic ("charge" then "refund") would lose the second event.
func TestWriteRefusesAnIDRepeatedOnATopic(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	db := pgtest.Pool(t)
	w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
	id := outbox.NewID()
	cases := map[string][]outbox.Message{
		"same topic": {
			{Topic: "payments", ID: id, Value: []byte("charge")},
			{Topic: "other", Value: []byte("x")},
			{Topic: "payments", ID: id, Value: []byte("refund")},
		},
		// The column is uuid: both spellings are one id.
		"other case": {
			{Topic: "payments", ID: id, Value: []byte("charge")},
			{Topic: "other", Value: []byte("x")},
			{Topic: "payments", ID: strings.ToUpper(id), Value: []byte("refund")},
		},
	}
	for name, msgs := range cases {
		err := w.Write(context.Background(), db, msgs...)
		if !errors.Is(err, outbox.ErrInvalidMessage) {
			t.Errorf("%s: err = %v, want ErrInvalidMessage", name, err)
			continue
		}
		for _, want := range []string{"message 2:", "message 0", strings.ToLower(msgs[2].ID)} {
			if !strings.Contains(strings.ToLower(err.Error()), want) {
				t.Errorf("%s: err = %q, want it to name %q", name, err, want)
			}
		}
	}
	if got := readOutbox(t, db, schema); len(got) != 0 {
		t.Fatalf("a rejected call wrote rows: %+v", got)
	}

	// One event fanned out to two topics keeps its id on both.
	if err := w.Write(context.Background(), db,
		outbox.Message{Topic: "payments", ID: id, Value: []byte("charge")},
		outbox.Message{Topic: "audit", ID: id, Value: []byte("charge")},
	); err != nil {
		t.Fatalf("one id on two topics: %v", err)
	}
	if got := readOutbox(t, db, schema); len(got) != 2 || got[0].eventID != id || got[1].eventID != id {
		t.Fatalf("got %+v", got)
	}
}

// fixedInjector injects the same headers whatever the context.
type fixedInjector map[string]string

func (f fixedInjector) InjectHeaders(_ context.Context, h map[string]string) {
	for k, v := range f {
		h[k] = v
	}
}

// Injected headers are stored as jsonb like the message's own: a value that
// is not UTF-8 was stored as U+FFFD (a signature altered silently), and a NUL
// failed every Write in PostgreSQL with SQLSTATE 22P05.
func TestWriteRefusesInjectedHeadersThatAreNotText(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	db := pgtest.Pool(t)
	cases := map[string]fixedInjector{
		"binary value":   {"sig": "\xca\xfe\xba\xbe"},
		"NUL in a value": {"baggage": "a\x00b"},
		"binary name":    {"k\xff": "v"},
		"NUL in a name":  {"a\x00": "v"},
	}
	for name, inject := range cases {
		w, err := outbox.NewWriter(&outbox.Config{Schema: schema, Inject: inject})
		if err != nil {
			t.Fatal(err)
		}
		err = w.Write(context.Background(), db, outbox.Message{Topic: "t", Value: []byte("v")})
		if !errors.Is(err, outbox.ErrInvalidMessage) {
			t.Errorf("%s: err = %v, want ErrInvalidMessage", name, err)
			continue
		}
		for k := range inject {
			if want := fmt.Sprintf("message 0: invalid message: injected header %q", k); !strings.Contains(err.Error(), want) {
				t.Errorf("%s: err = %q, want it to contain %q", name, err, want)
			}
		}
	}
	if got := readOutbox(t, db, schema); len(got) != 0 {
		t.Fatalf("a rejected call wrote rows: %+v", got)
	}

	// A header the message sets itself wins over the injected one, so the
	// injected value is never stored and the message is written.
	w, _ := outbox.NewWriter(&outbox.Config{Schema: schema, Inject: fixedInjector{"sig": "\xca\xfe\xba\xbe"}})
	err := w.Write(context.Background(), db, outbox.Message{Topic: "t", Headers: map[string]string{"sig": "yv66vg=="}})
	if err != nil {
		t.Fatalf("a message overriding the injected header: %v", err)
	}
	if got := readOutbox(t, db, schema); len(got) != 1 || got[0].headers["sig"] != "yv66vg==" {
		t.Fatalf("got %+v", got)
	}
}

// The id is stored as a uuid, so it is published in canonical lower case
// whatever case it was written in (Message.ID's doc says so).
func TestWriteStoresAnUpperCaseIDInLowerCase(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	db := pgtest.Pool(t)
	w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
	id := outbox.NewID()
	if err := w.Write(context.Background(), db, outbox.Message{Topic: "t", ID: strings.ToUpper(id)}); err != nil {
		t.Fatal(err)
	}
	if got := readOutbox(t, db, schema); len(got) != 1 || got[0].eventID != id {
		t.Fatalf("got %+v, want event_id %s", got, id)
	}
}
