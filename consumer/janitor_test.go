package consumer_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
)

func TestJanitorDeletesOnlyExpiredRecordsInBatches(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	table := pgx.Identifier{b.schema, "processed_messages"}.Sanitize()
	_, err := b.pool.Exec(ctx, `INSERT INTO `+table+` (consumer, message_id, processed_at)
		SELECT 'ledger', 'old-'||i, now() - interval '16 days' FROM generate_series(1, 2500) i
		UNION ALL SELECT 'ledger', 'new-'||i, now() - interval '14 days' FROM generate_series(1, 30) i`)
	if err != nil {
		t.Fatal(err)
	}
	j, err := consumer.NewJanitor(b.pool, &consumer.JanitorConfig{Schema: b.schema, BatchSize: 1000})
	if err != nil {
		t.Fatal(err)
	}
	n, err := j.Sweep(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != 2500 {
		t.Fatalf("deleted %d, want 2500", n)
	}
	if got := b.processedRows(t, "ledger"); got != 30 {
		t.Fatalf("rows left = %d, want the 30 inside the window", got)
	}

	// Run sweeps at once and returns nil when canceled.
	_, _ = b.pool.Exec(ctx, `UPDATE `+table+` SET processed_at = now() - interval '16 days'`)
	j, _ = consumer.NewJanitor(b.pool, &consumer.JanitorConfig{Schema: b.schema, Interval: time.Hour})
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- j.Run(runCtx) }()
	waitFor(t, 10*time.Second, "the first sweep", func() bool { return b.processedRows(t, "ledger") == 0 })
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
}

// The janitor's batch query walks the processed_at index, not the table.
func TestJanitorUsesProcessedAtIndex(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	table := pgx.Identifier{b.schema, "processed_messages"}.Sanitize()
	_, err := b.pool.Exec(ctx, `INSERT INTO `+table+` (consumer, message_id, processed_at)
		SELECT 'ledger', 'm-'||i, now() - (i || ' seconds')::interval FROM generate_series(1, 200000) i`)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.pool.Exec(ctx, `ANALYZE `+table); err != nil {
		t.Fatal(err)
	}
	// The janitor's batch query, its cutoff the longest window on record.
	rows, _ := b.pool.Query(ctx, `EXPLAIN SELECT ctid FROM `+table+
		` WHERE processed_at < now() - make_interval(secs => (SELECT greatest(1296000::bigint, max(window_seconds)) FROM `+
		pgx.Identifier{b.schema, "janitor_windows"}.Sanitize()+` WHERE seen_at > now() - make_interval(secs => window_seconds)))
		ORDER BY processed_at LIMIT 1000 FOR UPDATE SKIP LOCKED`)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	joined := ""
	for _, l := range lines {
		joined += l + "\n"
	}
	if !contains(joined, "processed_messages_processed_at_idx") {
		t.Fatalf("janitor query does not use the processed_at index:\n%s", joined)
	}
}

// A record can be read again for as long as Kafka keeps it, and with
// Kafka's defaults that is up to 14 days: retention.ms (7 days) counts from
// a segment's newest record, and a quiet topic rolls its segment only after
// segment.ms (7 days). A group idle for offsets.retention.minutes (7 days)
// loses its offsets and re-reads the topic from its start. The default
// window must keep a record that long.
func TestJanitorsDefaultWindowOutlastsKafkasDefaultRetention(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	table := pgx.Identifier{b.schema, "processed_messages"}.Sanitize()
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+table+` (consumer, message_id, processed_at)
		VALUES ('ledger', 'still-in-a-quiet-topic', now() - interval '14 days'),
		       ('ledger', 'gone-from-kafka', now() - interval '15 days 1 hour')`); err != nil {
		t.Fatal(err)
	}
	j, err := consumer.NewJanitor(b.pool, &consumer.JanitorConfig{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := j.Sweep(ctx); err != nil || n != 1 {
		t.Fatalf("Sweep = %d, %v; want 1 record deleted", n, err)
	}
	var left string
	if err := b.pool.QueryRow(ctx, `SELECT message_id FROM `+table).Scan(&left); err != nil || left != "still-in-a-quiet-topic" {
		t.Fatalf("left %q (%v), want the 14-day-old record kept", left, err)
	}
}

// Services sharing a schema share processed_messages, and a janitor sweeps
// every consumer's records. Janitors on one schema keep records for the
// longest window among them, so one service's short window expires no
// other service's records early; a window whose janitor has not swept
// within twice its length lapses.
func TestJanitorsOnASchemaKeepRecordsForTheLongestWindowAmongThem(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	table := pgx.Identifier{b.schema, "processed_messages"}.Sanitize()
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+table+` (consumer, message_id, processed_at)
		SELECT c, 'recent-'||i, now() - interval '2 days' FROM generate_series(1, 5) i, unnest(ARRAY['payments', 'notifications']) c
		UNION ALL SELECT c, 'old-'||i, now() - interval '61 days' FROM generate_series(1, 3) i, unnest(ARRAY['payments', 'notifications']) c`); err != nil {
		t.Fatal(err)
	}
	payments, err := consumer.NewJanitor(b.pool, &consumer.JanitorConfig{Schema: b.schema, Window: 60 * 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	notifications, err := consumer.NewJanitor(b.pool, &consumer.JanitorConfig{Schema: b.schema, Window: 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := payments.Sweep(ctx); err != nil || n != 6 {
		t.Fatalf("the 60-day janitor: Sweep = %d, %v; want the 6 records past 60 days", n, err)
	}
	if n, err := notifications.Sweep(ctx); err != nil || n != 0 {
		t.Fatalf("the 1-day janitor beside a 60-day one: Sweep = %d, %v; want nothing deleted", n, err)
	}
	// The 60-day janitor has not swept for over twice its window: it lapses.
	if _, err := b.pool.Exec(ctx, `UPDATE `+pgx.Identifier{b.schema, "janitor_windows"}.Sanitize()+
		` SET seen_at = now() - interval '121 days' WHERE window_seconds = 60 * 86400`); err != nil {
		t.Fatal(err)
	}
	if n, err := notifications.Sweep(ctx); err != nil || n != 10 {
		t.Fatalf("the 1-day janitor once the 60-day window lapsed: Sweep = %d, %v; want the 10 records past a day", n, err)
	}
}

// A window below an hour is a unit slip (168 meant as hours is 168 ns): it
// would delete records before their offsets are committed, and a
// redelivery would be processed again. An interval below a second would
// hammer the database with DELETEs.
func TestNewJanitorRefusesAWindowOrIntervalTooShort(t *testing.T) {
	b := setup(t)
	for _, cfg := range []consumer.JanitorConfig{
		{Window: 168},
		{Window: 168 * time.Millisecond},
		{Window: 59 * time.Minute},
		{Interval: time.Millisecond},
	} {
		cfg.Schema = b.schema
		if _, err := consumer.NewJanitor(b.pool, &cfg); err == nil {
			t.Errorf("NewJanitor(%+v) = nil error, want a refusal", cfg)
		}
	}
	if _, err := consumer.NewJanitor(b.pool, &consumer.JanitorConfig{Schema: b.schema, Window: time.Hour, Interval: time.Second}); err != nil {
		t.Errorf("NewJanitor at the floors: %v", err)
	}
}

// A janitor is seen only when it sweeps. One that sweeps less often than
// its window (a daily cron with a 2-hour window) lost its window between
// sweeps, and a shorter-window janitor deleted records the longer one
// keeps. An interval not under the window is refused, and a window lapses
// only after twice its length without a sweep (a cold review's case).
func TestALongerWindowHoldsBetweenItsJanitorsSweeps(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	table := pgx.Identifier{b.schema, "processed_messages"}.Sanitize()
	windows := pgx.Identifier{b.schema, "janitor_windows"}.Sanitize()
	if _, err := consumer.NewJanitor(b.pool, &consumer.JanitorConfig{Schema: b.schema, Window: 2 * time.Hour, Interval: 3 * time.Hour}); err == nil {
		t.Error("a janitor sweeping less often than its window was accepted")
	}
	long, err := consumer.NewJanitor(b.pool, &consumer.JanitorConfig{Schema: b.schema, Window: 2 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	short, err := consumer.NewJanitor(b.pool, &consumer.JanitorConfig{Schema: b.schema, Window: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := long.Sweep(ctx); err != nil {
		t.Fatal(err)
	}
	// The 2-hour janitor last swept 2h01m ago: late, not gone.
	if _, err := b.pool.Exec(ctx, `UPDATE `+windows+` SET seen_at = now() - interval '2 hours 1 minute' WHERE window_seconds = 7200`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+table+` (consumer, message_id, processed_at) VALUES ('payments', 'm1', now() - interval '90 minutes')`); err != nil {
		t.Fatal(err)
	}
	if n, err := short.Sweep(ctx); err != nil || n != 0 {
		t.Fatalf("a 1-hour janitor beside a late 2-hour one: Sweep = %d, %v; want nothing deleted", n, err)
	}
}

// A window that is not a whole number of seconds is kept whole: rounded
// up, never down.
func TestAWindowIsNeverCutToWholeSeconds(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	j, err := consumer.NewJanitor(b.pool, &consumer.JanitorConfig{Schema: b.schema, Window: time.Hour + 900*time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{b.schema, "processed_messages"}.Sanitize()+
		` (consumer, message_id, processed_at) VALUES ('payments', 'm1', now() - interval '3600.3 seconds')`); err != nil {
		t.Fatal(err)
	}
	if n, err := j.Sweep(ctx); err != nil || n != 0 {
		t.Fatalf("Sweep = %d, %v; want the 3600.3 s old record kept by a 3600.9 s window", n, err)
	}
}

// A janitor whose role lacks a privilege its sweep needs (UPDATE on
// processed_messages: the sweep locks the rows it deletes) says so at
// Error, to slog's default logger unless given one: it warned to a logger
// that discarded it by default, every interval, while the table grew
// without end (helper 76). It goes on, and sweeps once granted.
func TestAJanitorWithoutItsPrivilegesSaysSoAndSweepsOnceGranted(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	table := pgx.Identifier{schema, "processed_messages"}.Sanitize()
	pool := pgtest.RolePool(t, schema,
		`GRANT USAGE ON SCHEMA {s} TO {role}`,
		`GRANT SELECT, DELETE ON {s}.processed_messages TO {role}`, // no UPDATE
		`GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.janitor_windows TO {role}`)
	ctx := context.Background()
	if _, err := pgtest.Pool(t).Exec(ctx, `INSERT INTO `+table+` (consumer, message_id, processed_at) VALUES ('ledger', 'old', now() - interval '16 days')`); err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	j, err := consumer.NewJanitor(pool, &consumer.JanitorConfig{Schema: schema, Interval: time.Second, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- j.Run(runCtx) }()
	defer func() { cancel(); <-done }()
	waitUntil(t, "the refusal logged at Error", 10*time.Second, func() bool {
		return strings.Contains(logs.String(), "level=ERROR") && strings.Contains(logs.String(), "permission denied")
	})
	if _, err := pgtest.Pool(t).Exec(ctx, `GRANT UPDATE ON `+table+` TO `+pool.Config().ConnConfig.User); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the expired record swept once granted", 10*time.Second, func() bool {
		var n int
		if err := pgtest.Pool(t).QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
}

// syncBuffer is a bytes.Buffer safe for a logger's concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// waitUntil polls cond every 20 ms until it holds, failing after timeout.
func waitUntil(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(timeout); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
	}
}
