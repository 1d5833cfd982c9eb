package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
)

// runBatch takes msgs (one partition, offset order) to a final state, like
// runOne. It tries them in one transaction first (again, whole, after a
// conflict: see attemptBatchRetrying); if that fails, it falls back to one
// transaction per message so a poison message costs only itself.
func (p *Processor) runBatch(ctx context.Context, stop <-chan struct{}, msgs []Message, t Transport) error {
	good := make([]Message, 0, len(msgs))
	var bad []Message
	var badErr []error
	for _, m := range msgs {
		if m.skip {
			continue
		}
		id, err := p.messageID(m)
		if err != nil {
			bad = append(bad, m)
			badErr = append(badErr, err)
			continue
		}
		m.ID = id
		good = append(good, m)
	}
	deadLetter := func(m Message, cause error) error {
		if len(p.hooks.trace) > 0 {
			return p.traced(ctx, m, func(ctx context.Context) error { return p.deadLetter(ctx, stop, m, 0, 0, cause, t) })
		}
		return p.deadLetter(ctx, stop, m, 0, 0, cause, t)
	}
	if len(good) > 0 {
		switch err := p.attemptBatchRetrying(ctx, stop, good); {
		case err == nil:
		case ctx.Err() != nil || errors.Is(err, errAbandoned):
			return errAbandoned
		case IsPermanent(err) && errors.Is(err, pgx.ErrTxClosed):
			// The handler ended the batch's tx itself and wrote on:
			// committed, each message retried alone would be taken for
			// a duplicate, its later writes lost (see endedByHandler);
			// rolled back by SQL, its later writes are committed, and a
			// retry would write them again (rolledBackBySQL).
			p.log.Error("consumer: the batch handler ended its transaction itself and wrote on; the batch is dead-lettered",
				"topic", good[0].Topic, "partition", good[0].Partition, "first_offset", good[0].Offset, "size", len(good), "error", err)
			for _, m := range good {
				if err := deadLetter(m, err); err != nil {
					return err
				}
			}
		default:
			p.log.LogAttrs(ctx, slog.LevelWarn, "consumer: batch failed; retrying its messages one at a time",
				slog.String("topic", good[0].Topic), slog.Int("partition", int(good[0].Partition)),
				slog.Int64("first_offset", good[0].Offset), slog.Int("size", len(good)), slog.Any("error", err))
			for _, m := range good {
				// Stop drops what has not started: each message here
				// starts a transaction of its own.
				if stopped(stop) {
					return errAbandoned
				}
				if err := p.runOne(ctx, stop, m, t, true, nil); err != nil {
					return err
				}
			}
		}
	}
	for i, m := range bad {
		if err := deadLetter(m, badErr[i]); err != nil {
			return err
		}
	}
	return nil
}

// attemptBatch runs one transaction for msgs, whose IDs are set. When
// traced, each message's trace covers the transaction: it starts before
// BEGIN and ends after COMMIT, with the message's outcome, or abandoned with
// the batch's error if the batch failed (its messages are then processed
// one at a time, each in a trace of its own). The BatchHandler runs under
// ctx: its messages belong to many traces.
func (p *Processor) attemptBatch(ctx context.Context, stop <-chan struct{}, msgs []Message) error {
	if len(p.hooks.trace) == 0 {
		return p.batchTx(ctx, stop, msgs, nil)
	}
	traces := make([]context.Context, len(msgs))
	for i, m := range msgs {
		traces[i] = p.traceStart(ctx, m)
	}
	err := p.batchTx(ctx, stop, msgs, traces)
	for _, tctx := range traces {
		p.traceEnd(tctx, err)
	}
	return err
}

// batchTx is attemptBatch's transaction. traces, when not nil, are the
// messages' trace contexts, in which their outcomes are recorded.
func (p *Processor) batchTx(ctx context.Context, stop <-chan struct{}, msgs []Message, traces []context.Context) error {
	start := time.Now()
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.ID
	}
	release, err := p.holdSession(ctx, stop)
	if errors.Is(err, errAbandoned) {
		return err
	}
	if err != nil {
		return fmt.Errorf("consumer %s: begin: %w", p.name, err)
	}
	defer release()
	tx, err := p.db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("consumer %s: begin: %w", p.name, err)
	}
	defer rollback(ctx, tx)
	rows, err := tx.Query(ctx, p.insertAll, p.name, ids)
	if err != nil {
		return fmt.Errorf("consumer %s: record %d messages: %w", p.name, len(ids), err)
	}
	fresh := make(map[string]bool, len(ids))
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return fmt.Errorf("consumer %s: record %d messages: %w", p.name, len(ids), err)
		}
		fresh[id] = true
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("consumer %s: record %d messages: %w", p.name, len(ids), err)
	}
	// The first message with a new id is new; later ones with the same id
	// (re-published within the batch) are duplicates.
	isNew := make([]bool, len(msgs))
	todo := make([]Message, 0, len(fresh))
	for i, m := range msgs {
		if fresh[m.ID] {
			delete(fresh, m.ID)
			isNew[i] = true
			todo = append(todo, m)
		}
	}
	if len(todo) > 0 {
		pc := p.handlerStarts(stop, tx)
		htx := &handlerTx{Tx: tx}
		err := p.call(ctx, func() error { return p.batch(ctx, htx, todo) })
		p.handlerEnded(stop, pc)
		if err == nil && !htx.ended.Load() {
			err = p.rolledBackBySQL(ctx, tx, todo[0].ID)
		}
		if errors.Is(err, pgx.ErrTxClosed) {
			return p.endedByHandler(ctx, todo[0].ID, fmt.Errorf("consumer %s: the batch handler used tx after it ended (ending tx is the Processor's): %w", p.name, err))
		}
		if err != nil {
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			return fmt.Errorf("consumer %s: commit batch of %d: %w", p.name, len(todo), err)
		}
	}
	dur := time.Since(start)
	for _, h := range p.hooks.batch {
		h.OnBatch(BatchEvent{Consumer: p.name, Size: len(msgs), New: len(todo), Duration: dur})
	}
	for i, m := range msgs {
		o, n := Duplicate, 0
		if isNew[i] {
			o, n = Processed, 1
		}
		if traces != nil {
			p.finished(traces[i], m, o, n, 0, dur, len(msgs), true)
			continue
		}
		p.finished(ctx, m, o, n, 0, dur, len(msgs), true)
	}
	return nil
}
