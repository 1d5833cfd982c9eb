package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/proctest"
)

func TestDuplicateDeliveryHasOneEffect(t *testing.T) {
	b := setup(t)
	hooks := &counter{}
	p, err := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, Hooks: []consumer.Hook{hooks}})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	// The same record twice (a redelivery), then the same message-id
	// re-published at a new offset, then a different message.
	run(t, p, tr, msg(0, "id-1", "k"), msg(0, "id-1", "k"), msg(7, "id-1", "k"), msg(8, "id-2", "k"))

	if got := b.count(t, "message_id = 'id-1'"); got != 1 {
		t.Errorf("effects of id-1 = %d, want 1", got)
	}
	if got := b.count(t, "message_id = 'id-2'"); got != 1 {
		t.Errorf("effects of id-2 = %d, want 1", got)
	}
	if got := hooks.get(consumer.Duplicate); got != 2 {
		t.Errorf("duplicates reported = %d, want 2", got)
	}
	if got := hooks.get(consumer.Processed); got != 2 {
		t.Errorf("processed reported = %d, want 2", got)
	}
}

func TestConsumerNameScopesDedup(t *testing.T) {
	b := setup(t)
	for _, name := range []string{"ledger", "audit"} {
		p, err := consumer.New(b.pool, name, func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
			return b.record(ctx, tx, name, m)
		}, &consumer.Config{Schema: b.schema})
		if err != nil {
			t.Fatal(err)
		}
		run(t, p, &memTransport{}, msg(0, "id-1", ""), msg(1, "id-1", ""))
	}
	for _, name := range []string{"ledger", "audit"} {
		if got := b.count(t, "consumer = $1", name); got != 1 {
			t.Errorf("effects for %s = %d, want 1", name, got)
		}
	}
}

// Two processors of one consumer race on a message id: the second blocks on
// the unique index until the first commits, then sees the row and skips.
func TestConcurrentDuplicateBlocksThenSkips(t *testing.T) {
	b := setup(t)
	release := make(chan struct{})
	entered := make(chan struct{}, 2)
	handler := func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		entered <- struct{}{}
		select {
		case <-release:
		case <-ctx.Done():
			return ctx.Err()
		}
		return b.record(ctx, tx, "ledger", m)
	}
	hooks := &counter{}
	cfg := &consumer.Config{Schema: b.schema, Hooks: []consumer.Hook{hooks}}
	p1, _ := consumer.New(b.pool, "ledger", handler, cfg)
	p2, _ := consumer.New(b.pool, "ledger", handler, cfg)
	tr1, tr2 := &memTransport{}, &memTransport{}
	ctx := context.Background()
	w1 := p1.StartPartition(ctx, tr1)
	defer w1.Stop(canceled())
	if err := w1.Add(ctx, msg(0, "race", "")); err != nil {
		t.Fatal(err)
	}
	<-entered // the first holds the dedup row in an open transaction
	w2 := p2.StartPartition(ctx, tr2)
	defer w2.Stop(canceled())
	if err := w2.Add(ctx, msg(5, "race", "")); err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{b.schema, "processed_messages"}.Sanitize()
	waitFor(t, 10*time.Second, "the second insert to wait on a lock", func() bool {
		var waiting int
		err := b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND (query LIKE '%INSERT INTO '||$1||'%' OR query LIKE '%EXECUTE onceflow_dedup_%(%')`, table).Scan(&waiting)
		if err != nil {
			t.Fatal(err)
		}
		return waiting == 1
	})
	close(release)
	waitFor(t, 10*time.Second, "both marked done", func() bool { return tr1.lastMark() == 0 && tr2.lastMark() == 5 })
	if got := b.count(t, ""); got != 1 {
		t.Fatalf("effects = %d, want 1", got)
	}
	if hooks.get(consumer.Duplicate) != 1 || hooks.get(consumer.Processed) != 1 {
		t.Fatalf("outcomes = %v, want one processed and one duplicate", hooks.outcomes)
	}
	select {
	case <-entered:
		t.Fatal("the duplicate's handler ran")
	default:
	}
}

func TestRetriesThenDeadLetter(t *testing.T) {
	b := setup(t)
	var calls atomic.Int32
	hooks := &counter{}
	p, err := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		calls.Add(1)
		if err := b.record(ctx, tx, "ledger", m); err != nil {
			return err
		}
		return errors.New("account a1 is frozen")
	}, &consumer.Config{Schema: b.schema, MaxAttempts: 3, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond, Hooks: []consumer.Hook{hooks}})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{failDLQ: 2} // the dead-letter topic is briefly unavailable too
	m := msg(41, "id-1", "k1")
	m.Headers = append(m.Headers, consumer.Header{Key: "trace", Value: []byte("abc")})
	run(t, p, tr, m, msg(42, "id-2", "k1"))

	if got := calls.Load(); got != 3+3 {
		t.Errorf("handler calls = %d, want 6 (3 per message)", got)
	}
	if got := b.count(t, ""); got != 0 {
		t.Errorf("effects = %d, want 0: failed attempts roll back", got)
	}
	if got := b.processedRows(t, "ledger"); got != 0 {
		t.Errorf("dedup rows = %d, want 0: a failed attempt's row rolls back too", got)
	}
	dead := tr.deadLetters()
	if len(dead) != 2 {
		t.Fatalf("dead letters = %d, want 2", len(dead))
	}
	d := dead[0]
	want := map[string]string{
		consumer.HeaderDLQError:     "account a1 is frozen",
		consumer.HeaderDLQAttempts:  "3",
		consumer.HeaderDLQConsumer:  "ledger",
		consumer.HeaderDLQTopic:     "orders",
		consumer.HeaderDLQPartition: "0",
		consumer.HeaderDLQOffset:    "41",
		"message-id":                "id-1",
		"trace":                     "abc",
	}
	got := map[string]string{}
	for _, h := range d.Headers {
		got[h.Key] = string(h.Value)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("dead letter header %s = %q, want %q", k, got[k], v)
		}
	}
	if d.Topic != "orders.dlq" || string(d.Key) != "k1" || string(d.Value) != "v41" {
		t.Errorf("dead letter = %s %q %q, want orders.dlq k1 v41", d.Topic, d.Key, d.Value)
	}
	if hooks.retries != 4 || hooks.dead != 2 || hooks.get(consumer.DeadLettered) != 2 {
		t.Errorf("hooks: retries %d dead %d, want 4 and 2", hooks.retries, hooks.dead)
	}
}

func TestPermanentSkipsRetries(t *testing.T) {
	b := setup(t)
	var calls atomic.Int32
	p, _ := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		calls.Add(1)
		return consumer.Permanent(fmt.Errorf("malformed JSON"))
	}, &consumer.Config{Schema: b.schema, MaxAttempts: 10})
	tr := &memTransport{}
	run(t, p, tr, msg(0, "id-1", ""))
	if calls.Load() != 1 {
		t.Errorf("handler calls = %d, want 1", calls.Load())
	}
	dead := tr.deadLetters()
	if len(dead) != 1 || dead[0].Attempts != 1 || !consumer.IsPermanent(dead[0].Err) {
		t.Fatalf("dead letters = %+v, want one after 1 attempt", dead)
	}
}

func TestMessageWithoutIDIsDeadLettered(t *testing.T) {
	b := setup(t)
	var calls atomic.Int32
	p, _ := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		calls.Add(1)
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema})
	tr := &memTransport{}
	bad := msg(1, "", "")
	bad.Headers = []consumer.Header{{Key: "message-id", Value: []byte("a\x00b")}}
	run(t, p, tr, msg(0, "", ""), bad, msg(2, "ok", ""))
	if calls.Load() != 1 {
		t.Errorf("handler calls = %d, want 1 (only the message with an id)", calls.Load())
	}
	dead := tr.deadLetters()
	if len(dead) != 2 {
		t.Fatalf("dead letters = %d, want 2", len(dead))
	}
	for _, d := range dead {
		if !errors.Is(d.Err, consumer.ErrNoMessageID) || d.Attempts != 0 {
			t.Errorf("dead letter error = %v (attempts %d), want ErrNoMessageID after 0 attempts", d.Err, d.Attempts)
		}
	}
}

func TestCustomMessageID(t *testing.T) {
	b := setup(t)
	p, _ := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, MessageID: func(m consumer.Message) (string, error) {
		return "payment:" + string(m.Key), nil
	}})
	// Different message-ids, one business key: one effect.
	run(t, p, &memTransport{}, msg(0, "a", "p1"), msg(1, "b", "p1"), msg(2, "c", "p2"))
	if got := b.count(t, ""); got != 2 {
		t.Fatalf("effects = %d, want 2", got)
	}
	if got := b.count(t, "message_id = 'payment:p1'"); got != 1 {
		t.Fatalf("effects of payment:p1 = %d, want 1", got)
	}
}

func TestHandlerPanicIsRetried(t *testing.T) {
	b := setup(t)
	var calls atomic.Int32
	p, _ := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if calls.Add(1) == 1 {
			panic("nil map")
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, MinBackoff: time.Millisecond})
	run(t, p, &memTransport{}, msg(0, "id-1", ""))
	if calls.Load() != 2 || b.count(t, "") != 1 {
		t.Fatalf("calls %d effects %d, want 2 and 1", calls.Load(), b.count(t, ""))
	}
}

func TestKeyParallelKeepsKeyOrderAndCommitsBelowLowestUnfinished(t *testing.T) {
	b := setup(t)
	gate := make(chan struct{})
	var mu sync.Mutex
	seen := map[string][]int64{}
	p, err := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if m.Offset == 0 {
			<-gate // hold the first message of key "slow"
		}
		mu.Lock()
		seen[string(m.Key)] = append(seen[string(m.Key)], m.Offset)
		mu.Unlock()
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, Concurrency: 4})
	if err != nil {
		t.Fatal(err)
	}
	var msgs []consumer.Message
	msgs = append(msgs, msg(0, "m0", "slow"))
	keys := []string{"a", "b", "c", "slow"}
	for i := int64(1); i < 200; i++ {
		msgs = append(msgs, msg(i, "m"+strconv.FormatInt(i, 10), keys[i%int64(len(keys))]))
	}
	tr := &memTransport{}
	defer start(t, p, tr, msgs...).Stop(context.Background())
	// Other keys finish while offset 0 is held, but nothing is marked.
	waitFor(t, 20*time.Second, "other keys to be processed", func() bool { return b.count(t, "") >= 100 })
	if got := tr.lastMark(); got != -1 {
		t.Fatalf("marked offset %d while offset 0 is unfinished", got)
	}
	close(gate)
	waitFor(t, 20*time.Second, "all marked", func() bool { return tr.lastMark() == 199 })
	mu.Lock()
	defer mu.Unlock()
	for k, offs := range seen {
		for i := 1; i < len(offs); i++ {
			if offs[i] < offs[i-1] {
				t.Fatalf("key %s processed out of order: %v", k, offs)
			}
		}
	}
	tr.mu.Lock()
	for i := 1; i < len(tr.marks); i++ {
		if tr.marks[i] <= tr.marks[i-1] {
			t.Fatalf("marks not increasing: %v", tr.marks)
		}
	}
	tr.mu.Unlock()
	if got := b.count(t, ""); got != 200 {
		t.Fatalf("effects = %d, want 200", got)
	}
}

func TestStopDropsQueuedAndNeverMarksUnfinished(t *testing.T) {
	b := setup(t)
	entered := make(chan struct{})
	p, _ := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if m.Offset == 1 {
			close(entered)
			<-ctx.Done() // never finishes on its own
			return ctx.Err()
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema})
	tr := &memTransport{}
	ctx := context.Background()
	w := start(t, p, tr, msg(0, "m0", ""), msg(1, "m1", ""), msg(2, "m2", ""))
	<-entered
	stopCtx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	w.Stop(stopCtx) // grace runs out: offset 1's transaction is canceled
	if got := tr.lastMark(); got != 0 {
		t.Fatalf("last mark = %d, want 0", got)
	}
	if got := b.count(t, ""); got != 1 {
		t.Fatalf("effects = %d, want 1", got)
	}
	if err := w.Add(ctx, msg(3, "m3", "")); !errors.Is(err, consumer.ErrStopped) {
		t.Fatalf("Add after Stop = %v, want ErrStopped", err)
	}
}

// A handler that ignores its canceled context does not hold Stop (and so a
// rebalance) hostage: Stop abandons it, logging an Error that names the
// topic and partition, and the abandoned work neither commits nor marks
// anything done; delivered again, the message has one effect.
func TestStopAbandonsHandlerIgnoringCancel(t *testing.T) {
	b := setup(t)
	entered, release, returned := make(chan struct{}, 2), make(chan struct{}), make(chan struct{}, 2)
	var logs proctest.Buffer
	p, _ := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if m.Offset == 1 {
			entered <- struct{}{}
			<-release // a lock that takes no context
			defer func() { returned <- struct{}{} }()
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
	var msgs []consumer.Message
	for i, id := range []string{"m0", "m1", "m2"} {
		m := msg(int64(i), id, "")
		m.Partition = 3
		msgs = append(msgs, m)
	}
	tr := &memTransport{}
	ctx := context.Background()
	w := start(t, p, tr, msgs...)
	<-entered
	stopCtx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	stopped := make(chan struct{})
	go func() { w.Stop(stopCtx); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(30 * time.Second):
		close(release)
		t.Fatal("Stop waited for a handler that ignores its canceled context")
	}
	close(release)
	<-returned
	var abandoned []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if s, _ := rec["msg"].(string); strings.Contains(s, "ignored its canceled context") {
			abandoned = append(abandoned, rec)
		}
	}
	if len(abandoned) != 1 || abandoned[0]["level"] != "ERROR" || abandoned[0]["topic"] != "orders" || abandoned[0]["partition"] != float64(3) {
		t.Errorf("abandonment logged as %v, want one Error with topic orders and partition 3; log:\n%s", abandoned, logs.String())
	}
	// Delivered again (to the partition's next owner): the abandoned
	// transaction was rolled back when Stop closed its connection.
	tr2 := &memTransport{}
	run(t, p, tr2, msg(1, "m1", ""), msg(2, "m2", ""))
	<-returned
	checkAbandonedOnce(t, b, tr, 3)
}

// checkAbandonedOnce checks the end of a test whose stopped partition (tr)
// abandoned m1 at offset 1: nothing past offset 0 marked, m1's effect once,
// and dedup records in all.
func checkAbandonedOnce(t *testing.T, b *bundle, tr *memTransport, records int) {
	t.Helper()
	if got := tr.lastMark(); got != 0 {
		t.Errorf("last mark of the stopped partition = %d, want 0", got)
	}
	if got := b.count(t, "message_id = 'm1'"); got != 1 {
		t.Errorf("effects of m1 = %d, want 1", got)
	}
	if got := b.processedRows(t, "ledger"); got != records {
		t.Errorf("dedup records = %d, want %d", got, records)
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	h := func(context.Context, pgx.Tx, consumer.Message) error { return nil }
	for _, tc := range []struct {
		name string
		cfg  consumer.Config
		want string
	}{
		{"attempts", consumer.Config{MaxAttempts: -1}, "MaxAttempts"},
		{"backoff", consumer.Config{MinBackoff: time.Second, MaxBackoff: time.Millisecond}, "MaxBackoff"},
		{"concurrency", consumer.Config{Concurrency: -2}, "Concurrency"},
		{"queue bytes", consumer.Config{QueueBytes: -1}, "QueueBytes"},
		{"schema", consumer.Config{Schema: string(make([]byte, 70))}, "Schema"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := consumer.New(pgxBeginner{}, "c", h, &tc.cfg)
			if err == nil || !contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want one naming %s", err, tc.want)
			}
		})
	}
	if _, err := consumer.New(pgxBeginner{}, "", h, nil); err == nil {
		t.Fatal("empty name accepted")
	}
}

type pgxBeginner struct{}

func (pgxBeginner) Begin(context.Context) (pgx.Tx, error) { return nil, errors.New("unused") }

func contains(s, sub string) bool {
	return len(sub) == 0 || len(s) >= len(sub) && (s[:len(sub)] == sub || contains(s[1:], sub))
}

// canceled returns a canceled context: Stop with it abandons work at once.
func canceled() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}

// beginOnly hides the pool's Acquire, so the Processor takes its general
// path: BEGIN, then INSERT … ON CONFLICT DO NOTHING.
type beginOnly struct{ db consumer.Beginner }

func (b beginOnly) Begin(ctx context.Context) (pgx.Tx, error) { return b.db.Begin(ctx) }

func TestBeginnerWithoutPool(t *testing.T) {
	for _, tc := range []struct {
		name  string
		db    func(*bundle) consumer.Beginner
		plain bool
	}{
		{"beginner", func(b *bundle) consumer.Beginner { return beginOnly{b.pool} }, false},
		{"pool with PlainBegin", func(b *bundle) consumer.Beginner { return b.pool }, true},
	} {
		t.Run(tc.name, func(t *testing.T) { testPlainBegin(t, tc.db, tc.plain) })
	}
}

func testPlainBegin(t *testing.T, db func(*bundle) consumer.Beginner, plain bool) {
	b := setup(t)
	var calls atomic.Int32
	hooks := &counter{}
	p, err := consumer.New(db(b), "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if calls.Add(1) == 1 {
			return errors.New("transient")
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, MinBackoff: time.Millisecond, Hooks: []consumer.Hook{hooks}, PlainBegin: plain})
	if err != nil {
		t.Fatal(err)
	}
	run(t, p, &memTransport{}, msg(0, "id-1", ""), msg(1, "id-1", ""), msg(2, "id-2", ""))
	if b.count(t, "") != 2 || hooks.get(consumer.Duplicate) != 1 || hooks.retries != 1 {
		t.Fatalf("effects %d duplicates %d retries %d, want 2, 1, 1", b.count(t, ""), hooks.get(consumer.Duplicate), hooks.retries)
	}
}

// A message id that looks like SQL, or like the dollar quote, is only data.
func TestMessageIDIsNeverSQL(t *testing.T) {
	b := setup(t)
	p, _ := consumer.New(b.pool, "led'ger$of$", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return b.record(ctx, tx, "x", m)
	}, &consumer.Config{Schema: b.schema})
	ids := []string{`'); DROP TABLE x; --`, `$of$); DROP TABLE x; --`, `a\'b`, `$of0$$of$`, `$of`}
	var msgs []consumer.Message
	for i, id := range ids {
		msgs = append(msgs, msg(int64(i), id, ""), msg(int64(i+100), id, ""))
	}
	run(t, p, &memTransport{}, msgs...)
	for _, id := range ids {
		if got := b.count(t, "message_id = $1", id); got != 1 {
			t.Errorf("effects of %q = %d, want 1", id, got)
		}
	}
}

// flakyBeginner fails its first n Begins the way a database outage does.
type flakyBeginner struct {
	db consumer.Beginner
	n  atomic.Int32
}

func (f *flakyBeginner) Begin(ctx context.Context) (pgx.Tx, error) {
	if f.n.Add(-1) >= 0 {
		return nil, errors.New("dial tcp 127.0.0.1:5432: connect: connection refused")
	}
	return f.db.Begin(ctx)
}

// A database outage (no connection to be had) is waited out; it never
// spends a message's retry budget, so it never dead-letters messages. A
// connection lost under the handler (here terminated, as a restart does)
// spends only the separate lost-connection budget (MaxLostConnections,
// default 3), not MaxAttempts.
func TestDatabaseOutageDoesNotDeadLetter(t *testing.T) {
	b := setup(t)
	db := &flakyBeginner{db: b.pool}
	db.n.Store(5)
	var calls atomic.Int32
	p, _ := consumer.New(db, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if calls.Add(1) == 1 {
			// The connection dies under the handler.
			_, err := tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
			if err == nil {
				err = errors.New("backend survived")
			}
			return err
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, MaxAttempts: 1, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond})
	tr := &memTransport{}
	run(t, p, tr, msg(0, "id-1", ""))
	if len(tr.deadLetters()) != 0 {
		t.Fatalf("dead-lettered during an outage: %v", tr.deadLetters()[0].Err)
	}
	if b.count(t, "") != 1 {
		t.Fatalf("effects = %d, want 1", b.count(t, ""))
	}
}

// retryRecorder records the RetryEvents it is given.
type retryRecorder struct {
	mu     sync.Mutex
	events []consumer.RetryEvent
}

func (r *retryRecorder) OnRetry(e consumer.RetryEvent) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e)
}

func (r *retryRecorder) get() []consumer.RetryEvent {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.events)
}

// HookRetry promises a call after every failed attempt that will be
// retried: so also while the database is unreachable (here the pool dials
// a closed port), where the attempt fails before the handler runs. Once
// the database answers, the message is processed once.
func TestDatabaseOutageRetriesReachHookRetry(t *testing.T) {
	b := setup(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := uint16(l.Addr().(*net.TCPAddr).Port)
	l.Close()
	var down atomic.Bool
	down.Store(true)
	pool := ownPool(t, func(cfg *pgxpool.Config) {
		cfg.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
			if down.Load() {
				cc.Host, cc.Port, cc.Fallbacks = "127.0.0.1", closed, nil
			}
			return nil
		}
	})
	retries := &retryRecorder{}
	p, err := consumer.New(pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, MinBackoff: time.Millisecond, MaxBackoff: 20 * time.Millisecond, Hooks: []consumer.Hook{retries}})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	defer start(t, p, tr, msg(0, "id-0", "")).Stop(context.Background())
	waitFor(t, 10*time.Second, "three retries while the database is unreachable", func() bool { return len(retries.get()) >= 3 })
	down.Store(false)
	waitFor(t, 30*time.Second, "offset 0 marked done once the database answers", func() bool { return tr.lastMark() == 0 })
	for _, e := range retries.get() {
		var dial *net.OpError
		if e.Consumer != "ledger" || e.Message.Offset != 0 || e.Message.ID != "id-0" || e.Attempt != 0 || !errors.As(e.Err, &dial) || e.Backoff <= 0 {
			t.Errorf("retry event %+v, want one of ledger's message id-0 (offset 0), before any handler run, with the dial error and a backoff", e)
		}
	}
	if got := b.count(t, ""); got != 1 {
		t.Fatalf("effects = %d, want 1", got)
	}
}

// A handler abandoned by Stop (it ignores its canceled ctx) keeps its pool
// connection until it returns, but Stop closes that connection: the server
// rolls its transaction back at once, with the message's dedup record, so
// the message delivered again (to the partition's next owner) is processed
// while the abandoned handler still runs, and once. An earlier version left
// the transaction open, idle, until the handler returned: the redelivery's
// dedup insert waited on the uncommitted record all that time.
func TestStopClosesTheConnectionOfAnAbandonedHandler(t *testing.T) {
	for _, batch := range []bool{false, true} {
		t.Run(fmt.Sprintf("batch=%v", batch), func(t *testing.T) {
			b := setup(t)
			pool := ownPool(t, func(*pgxpool.Config) {})
			pid, release, returned := make(chan uint32, 1), make(chan struct{}), make(chan error, 1)
			handle := func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
				if m.Offset == 1 {
					var backend uint32
					if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
						return err
					}
					pid <- backend
					<-release // a lock that takes no context
					_, err := tx.Exec(context.Background(), `SELECT 1`)
					returned <- err
					return err
				}
				return b.record(ctx, tx, "ledger", m)
			}
			p := newLedgerProcessor(t, pool, batch, handle, &consumer.Config{Schema: b.schema})
			defer func() {
				select {
				case <-release:
				default:
					close(release)
				}
			}()
			ctx := context.Background()
			tr := &memTransport{}
			w := start(t, p, tr, msg(0, "m0", ""))
			waitFor(t, 10*time.Second, "offset 0 marked done", func() bool { return tr.lastMark() == 0 })
			if err := w.Add(ctx, msg(1, "m1", "")); err != nil {
				t.Fatal(err)
			}
			backend := <-pid
			stopCtx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
			defer cancel()
			w.Stop(stopCtx) // returns half a second after the cancel, the handler still running

			waitFor(t, 10*time.Second, "the abandoned handler's backend gone", func() bool {
				var n int
				_ = b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, backend).Scan(&n)
				return n == 0
			})
			// Delivered again: a Processor of the same name on another pool.
			tr2, part2 := redeliver(t, b, msg(1, "m1", ""))
			defer part2.Stop(ctx)
			waitFor(t, 10*time.Second, "the redelivery marked done while the abandoned handler runs", func() bool { return tr2.lastMark() == 1 })
			if n := pool.Stat().AcquiredConns(); n != 1 {
				t.Errorf("connections held = %d, want 1 (the abandoned handler's, until it returns)", n)
			}
			close(release)
			if err := <-returned; err == nil {
				t.Error("the abandoned handler's statement after its return succeeded: its connection was not closed")
			}
			waitFor(t, 10*time.Second, "the abandoned handler's connection back", func() bool { return pool.Stat().AcquiredConns() == 0 })
			checkAbandonedOnce(t, b, tr, 2)
		})
	}
}
