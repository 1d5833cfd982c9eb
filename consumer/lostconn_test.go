package consumer_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

// idleOut makes the server end the handler's session: the transaction sits
// idle past idle_in_transaction_session_timeout, as a handler waiting on a
// slow call does. If query is set, the handler then queries and gets the
// error; otherwise it returns nil and the COMMIT finds the session gone.
func idleOut(ctx context.Context, tx pgx.Tx, query bool) error {
	if _, err := tx.Exec(ctx, `SET LOCAL idle_in_transaction_session_timeout = '50ms'`); err != nil {
		return err
	}
	time.Sleep(300 * time.Millisecond) // the handler's slow call, not a wait for a condition
	if !query {
		return nil
	}
	_, err := tx.Exec(ctx, `SELECT 1`)
	return err
}

// A handler that loses its own connection (here the server ends its
// session for idling in its transaction) spends the message's budget for
// lost connections and is dead-lettered; the partition moves on (G6). It is
// not a database outage: only failing to get a working connection is. This
// holds whether the handler sees the error or the COMMIT does, in every
// mode, and when the next message is queued (pipelined commits).
func TestHandlerLosingItsConnectionIsDeadLettered(t *testing.T) {
	for _, tc := range []struct {
		name        string
		concurrency int
		batch       bool
		query       bool
	}{
		{"in order, handler sees the error", 1, false, true},
		{"in order, COMMIT sees it", 1, false, false},
		{"key-parallel, handler sees the error", 3, false, true},
		{"key-parallel, COMMIT sees it", 3, false, false},
		{"batch, handler sees the error", 1, true, true},
		{"batch, COMMIT sees it", 1, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t)
			handle := func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
				if string(m.Key) == "slow" {
					if err := idleOut(ctx, tx, tc.query); err != nil {
						return err
					}
				}
				return b.record(ctx, tx, "ledger", m)
			}
			cfg := &consumer.Config{Schema: b.schema, MaxAttempts: 2, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond, Concurrency: tc.concurrency}
			p := newLedgerProcessor(t, b.pool, tc.batch, handle, cfg)
			tr := &memTransport{}
			msgs := []consumer.Message{msg(0, "a", "fine")}
			msgs = append(msgs, msg(1, "b", "slow"))
			for i := 2; i < 6; i++ {
				msgs = append(msgs, msg(int64(i), "m"+strconv.Itoa(i), "fine"))
			}
			run(t, p, tr, msgs...)

			dead := tr.deadLetters()
			if len(dead) != 1 || dead[0].Message.Offset != 1 {
				t.Fatalf("dead letters = %d (%+v), want the message at offset 1", len(dead), dead)
			}
			if dead[0].Attempts != 3 {
				t.Errorf("dead letter after %d handler runs, want 3 (the default Config.MaxLostConnections)", dead[0].Attempts)
			}
			if got := b.count(t, ""); got != 5 {
				t.Errorf("effects = %d, want 5 (all but the dead letter)", got)
			}
			if got := b.count(t, "message_id = 'b'"); got != 0 {
				t.Errorf("effects of the dead-lettered message = %d, want 0", got)
			}
		})
	}
}

// Lost connections have a budget of their own (Config.MaxLostConnections),
// apart from MaxAttempts: a database restart under a handler costs the
// message one of those, not one of its attempts.
func TestLostConnectionBudgetIsSeparate(t *testing.T) {
	b := setup(t)
	runs := 0
	p, err := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		runs++
		if runs <= 2 {
			return idleOut(ctx, tx, true)
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema, MaxAttempts: 1, MaxLostConnections: 3, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	run(t, p, tr, msg(0, "a", ""))
	if len(tr.deadLetters()) != 0 {
		t.Fatalf("dead-lettered after two lost connections with MaxLostConnections 3: %v", tr.deadLetters()[0].Err)
	}
	if got := b.count(t, ""); got != 1 || runs != 3 {
		t.Fatalf("effects = %d after %d runs, want 1 after 3", got, runs)
	}
}
