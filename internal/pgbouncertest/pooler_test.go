package pgbouncertest_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgbouncertest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

// modes are the PgBouncer set-ups README's table reports on. PgBouncer
// 1.18 (Debian 12) keeps no prepared statements across transactions, so
// transaction mode needs pgx's exec or simple_protocol query mode (set in
// the URL); 1.21+ with max_prepared_statements does not.
func modes(t *testing.T) map[string]string {
	e := pgbouncertest.Start(t)
	return map[string]string{
		"session":          e.SessionURL,
		"transaction/exec": e.TransactionURL + "&default_query_exec_mode=exec",
	}
}

func poolFor(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Ping(ctx); err != nil {
		t.Fatalf("PgBouncer at %s: %v", strings.SplitN(url, "@", 2)[1], err)
	}
	return p
}

// relayBehind returns a relay, not running yet, whose pool (also returned)
// goes through url, on a fresh schema, with an in-process Kafka and a topic
// of two partitions there; batchSize 0 is the default.
func relayBehind(t *testing.T, url string, batchSize int) (schema, topic string, k *kafkatest.Kafka, pool *pgxpool.Pool, r *relay.Relay) {
	t.Helper()
	schema = pgtest.Schema(t)
	k = kafkatest.New(t)
	topic = k.Topic(t, 2)
	pool = poolFor(t, url)
	pub, err := kgopublisher.New(k.Brokers, &kgopublisher.Config{Opts: []kgo.Opt{kgo.MetadataMinAge(100 * time.Millisecond)}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	r, err = relay.New(pool, pub, &relay.Config{Schema: schema, PollInterval: 100 * time.Millisecond, BatchSize: batchSize})
	if err != nil {
		t.Fatal(err)
	}
	return schema, topic, k, pool, r
}

// TestRelayBehindPgBouncer: a relay whose pool goes through PgBouncer
// publishes every event and empties the outbox, in session and in
// transaction mode.
func TestRelayBehindPgBouncer(t *testing.T) {
	for mode, url := range modes(t) {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			schema, topic, k, pool, r := relayBehind(t, url, 0)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- r.Run(ctx) }()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("relay.Run: %v", err)
				}
			}()
			w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
			var msgs []outbox.Message
			for i := range 200 {
				msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint(i % 7)), Value: []byte("v")})
			}
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return w.Write(ctx, tx, msgs...) }); err != nil {
				t.Fatalf("outbox.Write through PgBouncer: %v", err)
			}
			waitUntil(t, "the outbox to drain", 60*time.Second, func() bool {
				var n int
				_ = pgtest.Pool(t).QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "outbox"}.Sanitize()).Scan(&n)
				return n == 0
			})
			if got := k.ReadAll(t, topic, 200, 30*time.Second); len(got) < 200 {
				t.Fatalf("read %d records, want 200", len(got))
			}
		})
	}
}

// TestRelayStopsWhereTheServerConnectionChangesUnderItsStatements: behind
// PgBouncer in transaction mode with pgx's default query mode (statements
// prepared and cached per client connection), the relay's statements meet
// server connections that lack them, or already have them. Before, the
// relay logged Warn lines and went on: rounds published and then not
// recorded were published again, and the drain nearly stopped (4,600
// records read in 60 s for 20,000 events, most of them lost rounds'
// duplicates). It must stop with an error that says what to change, and
// lose nothing: every event is still pending or was published.
func TestRelayStopsWhereTheServerConnectionChangesUnderItsStatements(t *testing.T) {
	e := pgbouncertest.Start(t)
	// No default_query_exec_mode: pgx prepares.
	schema, topic, k, _, r := relayBehind(t, e.TransactionURL, 200)
	const events = 20_000
	outboxTable := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := pgtest.Pool(t).Exec(context.Background(), `INSERT INTO `+outboxTable+` (topic, key, value)
SELECT $1, ('k' || (g % 100))::bytea, 'v'::bytea FROM generate_series(1, $2) g`, topic, events); err != nil {
		t.Fatal(err)
	}
	all := eventIDs(t, outboxTable)
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	var err error
	select {
	case err = <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("the relay still runs after 60 s behind a pooler that changes its server connection between transactions")
	}
	if !errors.Is(err, relay.ErrPreparedStatementsLost) {
		t.Fatalf("relay.Run returned %v, want relay.ErrPreparedStatementsLost", err)
	}
	if !strings.Contains(err.Error(), "default_query_exec_mode=exec") {
		t.Errorf("the error does not say what to change: %v", err)
	}
	pending := eventIDs(t, outboxTable)
	ends, err := k.Admin(t).ListEndOffsets(context.Background(), topic)
	if err != nil {
		t.Fatal(err)
	}
	var records int
	ends.Each(func(o kadm.ListedOffset) { records += int(o.Offset) })
	published := map[string]bool{}
	for _, rec := range k.ReadAll(t, topic, records, 30*time.Second) {
		published[messageID(rec)] = true
	}
	lost := 0
	for id := range all {
		if !pending[id] && !published[id] {
			lost++
		}
	}
	if lost > 0 {
		t.Fatalf("%d of %d events neither pending nor published (%d pending, %d published)", lost, events, len(pending), len(published))
	}
	t.Logf("stopped with %d events pending, %d published in %d records", len(pending), len(published), records)
}

// eventIDs returns the event ids in table.
func eventIDs(t *testing.T, table string) map[string]bool {
	t.Helper()
	rows, err := pgtest.Pool(t).Query(context.Background(), `SELECT event_id::text FROM `+table)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]bool, len(ids))
	for _, id := range ids {
		out[id] = true
	}
	return out
}

// Behind a pooler, a statement lost mid-run (DEALLOCATE ALL on the relay's
// idle connections: what transaction mode does to each transaction, here
// through session mode so that the run starts cleanly) stops the relay
// with ErrPreparedStatementsLost, after its start.
func TestRelayBehindAPoolerStopsWhenItsStatementsAreLostMidRun(t *testing.T) {
	e := pgbouncertest.Start(t)
	schema, topic, _, pool, r := relayBehind(t, e.SessionURL, 0)
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
	write := func() {
		if err := pgx.BeginFunc(context.Background(), pgtest.Pool(t), func(tx pgx.Tx) error {
			return w.Write(context.Background(), tx, outbox.Message{Topic: topic, Key: []byte("k"), Value: []byte("v")})
		}); err != nil {
			t.Fatal(err)
		}
	}
	write()
	outboxTable := pgx.Identifier{schema, "outbox"}.Sanitize()
	waitUntil(t, "the first event to be published", 30*time.Second, func() bool {
		var n int
		_ = pgtest.Pool(t).QueryRow(context.Background(), `SELECT count(*) FROM `+outboxTable).Scan(&n)
		return n == 0
	})
	deadline := time.After(30 * time.Second)
	var err error
	for {
		for _, c := range pool.AcquireAllIdle(context.Background()) {
			_, err := c.Conn().PgConn().Exec(context.Background(), "DEALLOCATE ALL").ReadAll()
			c.Release()
			if err != nil {
				t.Fatal(err)
			}
		}
		write()
		select {
		case err = <-done:
		case <-time.After(50 * time.Millisecond):
			continue
		case <-deadline:
			t.Fatal("the relay still runs 30 s after its statements began to be lost behind a pooler")
		}
		break
	}
	if !errors.Is(err, relay.ErrPreparedStatementsLost) {
		t.Fatalf("relay.Run returned %v, want relay.ErrPreparedStatementsLost", err)
	}
}

// messageID is a record's onceflow message id header.
func messageID(rec *kgo.Record) string {
	for _, h := range rec.Headers {
		if h.Key == relay.MessageIDHeader {
			return string(h.Value)
		}
	}
	return ""
}

// TestConsumerBehindPgBouncer: the idempotent consumer applies every
// message once through PgBouncer, with pipelined commits and with
// Config.PlainBegin, in session and in transaction mode.
func TestConsumerBehindPgBouncer(t *testing.T) {
	for mode, url := range modes(t) {
		for _, plain := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/PlainBegin=%v", mode, plain), func(t *testing.T) {
				testConsumer(t, url, plain)
			})
		}
	}
}

func testConsumer(t *testing.T, url string, plain bool) {
	t.Parallel()
	schema := pgtest.Schema(t)
	k := kafkatest.New(t)
	topic := k.Topic(t, 2)
	cl := k.Client(t)
	ctx := context.Background()
	ids := make([]string, 80)
	for i := range ids {
		ids[i] = fmt.Sprintf("m-%d", i)
	}
	for i := range 100 {
		r := &kgo.Record{Topic: topic, Key: []byte(fmt.Sprint(i % 5)), Value: []byte("v"),
			Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte(ids[i%80])}}} // 20 duplicates
		if err := cl.ProduceSync(ctx, r).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	// The sessions show in pg_stat_activity under this name (PgBouncer
	// sets a client's application_name on the server it lends it).
	app := "pgbt_" + strings.TrimPrefix(schema, "oftest_")
	pool := poolFor(t, url+"&application_name="+app)
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := pgtest.Pool(t).Exec(ctx, `CREATE TABLE `+effects+` (id text)`); err != nil {
		t.Fatal(err)
	}
	tl := newTestLog(t)
	seen := newOutcomes(tl)
	p, err := consumer.New(pool, "pgb", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+effects+` VALUES ($1)`, m.ID)
		return err
	}, &consumer.Config{Schema: schema, PlainBegin: plain, Logger: tl.slog(), Hooks: []consumer.Hook{seen}})
	if err != nil {
		t.Fatal(err)
	}
	c, err := kgoconsumer.New(p, &kgoconsumer.Config{Brokers: k.Brokers, Topics: []string{topic}, Logger: tl.slog(),
		ClientOpts: []kgo.Opt{kgo.MetadataMinAge(100 * time.Millisecond), kgo.FetchMaxWait(200 * time.Millisecond),
			kgo.WithLogger(kgoLogger{tl})}})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	n := 0
	if !waitFor(90*time.Second, func() bool {
		_ = pgtest.Pool(t).QueryRow(ctx, `SELECT count(*) FROM `+effects).Scan(&n)
		return n >= 80
	}) {
		consumerReport(t, schema, app, ids, seen)
		t.Fatalf("timed out after 90s waiting for 80 effects (%d counted; report above)", n)
	}
	var distinct int
	if err := pgtest.Pool(t).QueryRow(ctx, `SELECT count(*), count(DISTINCT id) FROM `+effects).Scan(&n, &distinct); err != nil {
		t.Fatal(err)
	}
	if n != 80 || distinct != 80 {
		consumerReport(t, schema, app, ids, seen)
		t.Fatalf("effects %d (%d distinct), want 80 once each", n, distinct)
	}
}

// TestIdempotencyBehindPgBouncer: the middleware runs a keyed request once
// and replays it, in both modes and both PgBouncer modes.
func TestIdempotencyBehindPgBouncer(t *testing.T) {
	for mode, url := range modes(t) {
		for _, im := range []idempotency.Mode{idempotency.Transactional, idempotency.Leased} {
			t.Run(fmt.Sprintf("%s/%v", mode, im), func(t *testing.T) {
				t.Parallel()
				schema := pgtest.Schema(t)
				pool := poolFor(t, url)
				mw, err := idempotency.New(pool, &idempotency.Config{Schema: schema, Mode: im, Scope: idempotency.SharedScope})
				if err != nil {
					t.Fatal(err)
				}
				var mu sync.Mutex
				runs := 0
				srv := httptest.NewServer(mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					mu.Lock()
					runs++
					mu.Unlock()
					w.WriteHeader(http.StatusCreated)
					_, _ = io.WriteString(w, "made")
				})))
				defer srv.Close()
				for i := range 3 {
					req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{"a":1}`))
					req.Header.Set("Idempotency-Key", "k-1")
					resp, err := http.DefaultClient.Do(req)
					if err != nil {
						t.Fatal(err)
					}
					body, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					replayed := resp.Header.Get("Idempotent-Replayed") == "true"
					if resp.StatusCode != http.StatusCreated || string(body) != "made" || replayed != (i > 0) {
						t.Fatalf("request %d: %d %q replayed=%v", i, resp.StatusCode, body, replayed)
					}
				}
				if runs != 1 {
					t.Fatalf("handler ran %d times, want 1", runs)
				}
			})
		}
	}
}

func waitUntil(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	if !waitFor(timeout, cond) {
		t.Fatalf("timed out after %s waiting for %s", timeout, what)
	}
}

// waitFor polls cond until it holds (true) or timeout passes (false).
func waitFor(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
	return true
}
