package consumer_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/consumer"
)

// splitCounter counts messages finished by a per-message transaction in
// batch mode: a batch that failed was split.
type splitCounter struct {
	mu    sync.Mutex
	split int
}

func (s *splitCounter) OnDone(e consumer.DoneEvent) {
	if e.Outcome == consumer.Processed && !e.Batched {
		s.mu.Lock()
		s.split++
		s.mu.Unlock()
	}
}

// The user runs the consumer's sessions at SERIALIZABLE (a role or pool
// default; the Processor has no isolation option of its own), and the
// handlers of several partitions credit one hot account. PostgreSQL rolls
// some transactions back with serialization failures (SQLSTATE 40001),
// which it documents as "retry the transaction". They used to spend
// MaxAttempts like a handler bug, and valid messages were dead-lettered
// (helper 91: 3-4 of 180), their effects never applied; in batch mode a
// conflicting batch was split into per-message transactions.
func TestSerializableHandlersOnAHotRowAreNeverDeadLettered(t *testing.T) {
	inBothModes(t, func(t *testing.T, batch bool) {
		b := setup(t)
		pool := ownPool(t, func(c *pgxpool.Config) {
			c.MaxConns = 8
			c.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
		})
		acct := pgx.Identifier{b.schema, "acct"}.Sanitize()
		if _, err := b.pool.Exec(context.Background(), `CREATE TABLE `+acct+` (id int primary key, bal bigint not null); INSERT INTO `+acct+` VALUES (1, 0)`); err != nil {
			t.Fatal(err)
		}
		think := 5 * time.Millisecond // the handler's own work between its read and its write
		if batch {
			think = time.Millisecond
		}
		splits := &splitCounter{}
		p := newLedgerProcessor(t, pool, batch, func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
			var bal int64
			if err := tx.QueryRow(ctx, `SELECT bal FROM `+acct+` WHERE id = 1`).Scan(&bal); err != nil {
				return err
			}
			time.Sleep(think)
			_, err := tx.Exec(ctx, `UPDATE `+acct+` SET bal = $1 WHERE id = 1`, bal+1)
			return err
		}, &consumer.Config{Schema: b.schema, BatchSize: 10, Hooks: []consumer.Hook{splits}}) // MaxAttempts 5, backoff 100ms..10s
		const parts, per = 6, 30
		ctx := context.Background()
		trs := make([]*memTransport, parts)
		for i := range parts {
			trs[i] = &memTransport{}
			var ms []consumer.Message
			for j := range per {
				m := msg(int64(j), fmt.Sprintf("p%d-%d", i, j), "")
				m.Partition = int32(i)
				ms = append(ms, m)
			}
			w := p.StartPartition(ctx, trs[i])
			defer w.Stop(ctx)
			if err := w.Add(ctx, ms...); err != nil {
				t.Fatal(err)
			}
		}
		for i := range parts {
			waitFor(t, 5*time.Minute, "partition done", func() bool { return trs[i].lastMark() == per-1 })
		}
		dead := 0
		for _, tr := range trs {
			for _, d := range tr.deadLetters() {
				dead++
				if dead == 1 {
					t.Logf("first dead letter: offset %d, attempts %d, error: %v", d.Message.Offset, d.Attempts, d.Err)
				}
			}
		}
		var bal int64
		if err := b.pool.QueryRow(ctx, `SELECT bal FROM `+acct).Scan(&bal); err != nil {
			t.Fatal(err)
		}
		t.Logf("messages %d, balance %d, dead-lettered %d, processed outside a batch transaction %d", parts*per, bal, dead, splits.split)
		if dead > 0 || bal != parts*per {
			t.Errorf("%d of %d valid messages were dead-lettered for serialization failures (SQLSTATE 40001, transient by definition); balance %d, want %d", dead, parts*per, bal, parts*per)
		}
		if batch && splits.split > 0 {
			t.Errorf("%d messages were processed one at a time: a batch that hit a serialization failure was split instead of retried whole", splits.split)
		}
	})
}

// A serialization failure (40001) or deadlock (40P01) is retried apart from
// MaxAttempts, up to MaxConflicts, then counts as a handler failure; a
// batch is retried whole. Lock and statement timeouts, and a conflict the
// handler marks Permanent, stay handler failures.
func TestConflictsAreRetriedApartFromMaxAttempts(t *testing.T) {
	for _, tc := range []struct {
		name         string
		code         string
		fails        int // runs that fail; -1: every run
		permanent    bool
		maxConflicts int
		dead         bool // dead-lettered
		conflict     bool // RetryEvent.Conflict
	}{
		{name: "serialization failure", code: "40001", fails: 3},
		{name: "deadlock", code: "40P01", fails: 3},
		{name: "lock timeout", code: "55P03", fails: 3, dead: true},
		{name: "statement timeout", code: "57014", fails: 3, dead: true},
		{name: "permanent serialization failure", code: "40001", fails: 3, permanent: true, dead: true, conflict: true},
		{name: "conflicts past MaxConflicts", code: "40001", fails: -1, maxConflicts: 2, dead: true, conflict: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inBothModes(t, func(t *testing.T, batch bool) {
				b := setup(t)
				var mu sync.Mutex
				runs := 0
				retries, splits := &retryRecorder{}, &splitCounter{}
				p := newLedgerProcessor(t, b.pool, batch, func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
					mu.Lock()
					runs++
					fail := tc.fails < 0 || runs <= tc.fails
					mu.Unlock()
					if !fail {
						return b.record(ctx, tx, "ledger", m)
					}
					_, err := tx.Exec(ctx, `DO $$BEGIN RAISE EXCEPTION 'test failure' USING ERRCODE = '`+tc.code+`'; END$$`)
					if tc.permanent {
						return consumer.Permanent(err)
					}
					return err
				}, &consumer.Config{Schema: b.schema, MaxAttempts: 2, MaxConflicts: tc.maxConflicts,
					MinBackoff: time.Millisecond, MaxBackoff: 2 * time.Millisecond, Hooks: []consumer.Hook{retries, splits}})
				tr := &memTransport{}
				run(t, p, tr, msg(0, "m-0", ""))
				dead := tr.deadLetters()
				mu.Lock()
				var flags []bool
				for _, e := range retries.get() {
					flags = append(flags, e.Conflict)
				}
				t.Logf("runs %d, dead letters %d, retries (their Conflict) %v, processed outside a batch transaction %d", runs, len(dead), flags, splits.split)
				mu.Unlock()
				if got := len(dead) == 1; got != tc.dead {
					t.Fatalf("dead-lettered: %v, want %v (dead letters: %v)", got, tc.dead, dead)
				}
				if !tc.dead {
					if n := b.count(t, "message_id = $1", "m-0"); n != 1 {
						t.Errorf("effects of m-0: %d, want 1", n)
					}
					if len(flags) != tc.fails || slices.Contains(flags, false) {
						t.Errorf("retries reported with Conflict %v, want %d, each with Conflict set", flags, tc.fails)
					}
					if batch && splits.split > 0 {
						t.Errorf("the batch was split after a conflict instead of retried whole")
					}
				}
				if tc.dead && !tc.conflict {
					if slices.Contains(flags, true) {
						t.Errorf("RetryEvent.Conflict set for SQLSTATE %s: %v", tc.code, flags)
					}
				}
				if tc.maxConflicts > 0 && !batch {
					if got := dead[0].Attempts; got != tc.maxConflicts+2 {
						t.Errorf("dead letter's attempts %d, want MaxConflicts %d + MaxAttempts 2", got, tc.maxConflicts)
					}
				}
			})
		})
	}
}
