package consumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

func TestJanitorDeletesOnlyExpiredRecordsInBatches(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	table := pgx.Identifier{b.schema, "processed_messages"}.Sanitize()
	_, err := b.pool.Exec(ctx, `INSERT INTO `+table+` (consumer, message_id, processed_at)
		SELECT 'ledger', 'old-'||i, now() - interval '8 days' FROM generate_series(1, 2500) i
		UNION ALL SELECT 'ledger', 'new-'||i, now() - interval '6 days' FROM generate_series(1, 30) i`)
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
	_, _ = b.pool.Exec(ctx, `UPDATE `+table+` SET processed_at = now() - interval '1 hour'`)
	j, _ = consumer.NewJanitor(b.pool, &consumer.JanitorConfig{Schema: b.schema, Window: time.Minute, Interval: time.Hour})
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
	rows, _ := b.pool.Query(ctx, `EXPLAIN SELECT ctid FROM `+table+
		` WHERE processed_at < now() - interval '7 days' ORDER BY processed_at LIMIT 1000 FOR UPDATE SKIP LOCKED`)
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
