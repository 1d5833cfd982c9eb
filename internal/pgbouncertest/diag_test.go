package pgbouncertest_test

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// Diagnostics for the consumer tests: when one times out it says what the
// consumer did and what its database sessions were doing, so a failure on
// a loaded CI machine explains itself.

// testLog is a sink for t.Log that goes quiet once the test ended
// (work the consumer abandoned may log later, and t.Log then panics).
type testLog struct {
	mu    sync.Mutex
	t     testing.TB
	start time.Time
	ended bool
}

func newTestLog(t testing.TB) *testLog {
	l := &testLog{t: t, start: time.Now()}
	t.Cleanup(func() { l.mu.Lock(); l.ended = true; l.mu.Unlock() })
	return l
}

func (l *testLog) logf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.ended {
		l.t.Logf("%7.3fs "+format, append([]any{time.Since(l.start).Seconds()}, args...)...)
	}
}

// slog is a Debug logger into the test's log.
func (l *testLog) slog() *slog.Logger {
	return slog.New(&slogHandler{l: l, level: slog.LevelDebug})
}

type slogHandler struct {
	l     *testLog
	level slog.Level
	attrs string
}

func (h *slogHandler) Enabled(_ context.Context, lv slog.Level) bool { return lv >= h.level }

func (h *slogHandler) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(h.attrs)
	r.Attrs(func(a slog.Attr) bool {
		fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
		return true
	})
	h.l.logf("%s %s%s", r.Level, r.Message, b.String())
	return nil
}

func (h *slogHandler) WithAttrs(as []slog.Attr) slog.Handler {
	var b strings.Builder
	b.WriteString(h.attrs)
	for _, a := range as {
		fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
	}
	return &slogHandler{l: h.l, level: h.level, attrs: b.String()}
}

func (h *slogHandler) WithGroup(string) slog.Handler { return h }

// kgoLogger puts franz-go's group events (joins, assignments, revokes,
// commits) into the test's log; its Debug level (every fetch) stays out.
type kgoLogger struct{ l *testLog }

func (k kgoLogger) Level() kgo.LogLevel { return kgo.LogLevelInfo }

func (k kgoLogger) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	k.l.logf("kgo %s %s %v", level, msg, keyvals)
}

// outcomes records what the consumer did with each message id: a
// consumer.Hook for HookDone, HookRetry and HookDeadLetter.
type outcomes struct {
	mu   sync.Mutex
	l    *testLog
	seen map[string][]string
}

func newOutcomes(l *testLog) *outcomes { return &outcomes{l: l, seen: map[string][]string{}} }

func (o *outcomes) add(id, what string) {
	o.mu.Lock()
	o.seen[id] = append(o.seen[id], what)
	o.mu.Unlock()
}

func (o *outcomes) OnDone(e consumer.DoneEvent) {
	o.add(e.Message.ID, fmt.Sprintf("%s@%d/%d", e.Outcome, e.Message.Partition, e.Message.Offset))
	o.l.logf("done %s p%d o%d %s attempts=%d in %s", e.Message.ID, e.Message.Partition, e.Message.Offset, e.Outcome, e.Attempts, e.Duration)
}

func (o *outcomes) OnRetry(e consumer.RetryEvent) {
	o.add(e.Message.ID, fmt.Sprintf("retry@%d/%d", e.Message.Partition, e.Message.Offset))
}

func (o *outcomes) OnDeadLetter(e consumer.DeadLetterEvent) {
	o.add(e.Message.ID, fmt.Sprintf("dead-lettered@%d/%d", e.Message.Partition, e.Message.Offset))
}

func (o *outcomes) of(id string) []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Clone(o.seen[id])
}

// consumerReport logs, for a consumer test that timed out, the effects
// counted and the ids missing (with what the consumer did with each), and
// the database's view: the sessions of the test (application_name app, or
// a query naming its schema) and every lock wait.
func consumerReport(t *testing.T, schema, app string, ids []string, o *outcomes) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	db := pgtest.Pool(t)
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	var b strings.Builder
	have := map[string]int{}
	rows, err := db.Query(ctx, `SELECT id, count(*) FROM `+effects+` GROUP BY id`)
	if err == nil {
		for rows.Next() {
			var id string
			var n int
			if rows.Scan(&id, &n) == nil {
				have[id] = n
			}
		}
		err = rows.Err()
	}
	if err != nil {
		fmt.Fprintf(&b, "effects: %v\n", err)
	}
	total := 0
	for _, n := range have {
		total += n
	}
	fmt.Fprintf(&b, "effects: %d rows, %d distinct ids of %d\n", total, len(have), len(ids))
	var missing []string
	for _, id := range ids {
		if have[id] == 0 {
			missing = append(missing, id)
		}
	}
	fmt.Fprintf(&b, "missing ids (%d):", len(missing))
	for _, id := range missing {
		fmt.Fprintf(&b, " %s%v", id, o.of(id))
	}
	b.WriteString("\n")
	var recorded int
	_ = db.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "processed_messages"}.Sanitize()).Scan(&recorded)
	fmt.Fprintf(&b, "processed_messages: %d rows\n", recorded)

	b.WriteString("pg_stat_activity (the test's sessions):\n")
	rows, err = db.Query(ctx, `SELECT pid, coalesce(state, ''), coalesce(wait_event_type || '/' || wait_event, ''),
		coalesce(now() - xact_start, '0'::interval)::text, pg_blocking_pids(pid)::text, left(coalesce(query, ''), 300)
		FROM pg_stat_activity
		WHERE pid <> pg_backend_pid() AND (application_name = $1 OR strpos(query, $2) > 0)
		ORDER BY pid`, app, schema)
	writeRows(&b, rows, err, 6)
	b.WriteString("pg_locks waits (any session):\n")
	rows, err = db.Query(ctx, `SELECT l.pid, l.locktype, l.mode, coalesce(l.relation::regclass::text, l.transactionid::text, ''),
		pg_blocking_pids(l.pid)::text, coalesce(a.application_name, ''), left(coalesce(a.query, ''), 200)
		FROM pg_locks l LEFT JOIN pg_stat_activity a USING (pid)
		WHERE NOT l.granted ORDER BY l.pid`)
	writeRows(&b, rows, err, 7)
	t.Log("consumer report:\n" + b.String())
}

// writeRows writes text rows of n columns, one a line.
func writeRows(b *strings.Builder, rows pgx.Rows, err error, n int) {
	if err != nil {
		fmt.Fprintf(b, "  %v\n", err)
		return
	}
	defer rows.Close()
	count := 0
	for rows.Next() {
		vals, err := rows.Values()
		if err != nil {
			fmt.Fprintf(b, "  %v\n", err)
			return
		}
		b.WriteString(" ")
		for _, v := range vals[:min(n, len(vals))] {
			fmt.Fprintf(b, " | %v", v)
		}
		b.WriteString("\n")
		count++
	}
	if err := rows.Err(); err != nil {
		fmt.Fprintf(b, "  %v\n", err)
	}
	if count == 0 {
		b.WriteString("  (none)\n")
	}
}
