package consumer_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

// tracer records TraceStart/TraceRetry/TraceEnd and marks the context it
// hands out, so the test can see the handler runs under it.
type tracer struct {
	mu      sync.Mutex
	started int
	retries map[int64]int
	ends    []consumer.TraceEndEvent
}

type spanKey struct{}

func (tr *tracer) TraceStart(ctx context.Context, e consumer.TraceStartEvent) context.Context {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.started++
	return context.WithValue(ctx, spanKey{}, e.Message.Offset)
}

func (tr *tracer) TraceRetry(ctx context.Context, e consumer.RetryEvent) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if ctx.Value(spanKey{}) != e.Message.Offset {
		panic("TraceRetry without TraceStart's context")
	}
	if tr.retries == nil {
		tr.retries = map[int64]int{}
	}
	tr.retries[e.Message.Offset]++
}

func (tr *tracer) TraceEnd(ctx context.Context, e consumer.TraceEndEvent) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if ctx.Value(spanKey{}) != e.Message.Offset {
		panic("TraceEnd without TraceStart's context")
	}
	tr.ends = append(tr.ends, e)
}

func (tr *tracer) end(offset int64) (consumer.TraceEndEvent, int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	var ev consumer.TraceEndEvent
	n := 0
	for _, e := range tr.ends {
		if e.Message.Offset == offset {
			ev = e
			n++
		}
	}
	return ev, n
}

func TestTraceHookWrapsEachMessageWithItsOutcome(t *testing.T) {
	inBothModes(t, func(t *testing.T, batch bool) {
		b := setup(t)
		tr := &tracer{}
		failures := 0
		handle := func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
			if ctx.Value(spanKey{}) != m.Offset {
				return consumer.Permanent(errors.New("handler runs without TraceStart's context"))
			}
			switch string(m.Value) {
			case "v2": // fails once, then commits
				if failures++; failures == 1 {
					return errors.New("transient")
				}
			case "v3":
				return consumer.Permanent(errors.New("poison"))
			}
			return b.record(ctx, tx, "ledger", m)
		}
		cfg := &consumer.Config{Schema: b.schema, Hooks: []consumer.Hook{tr}, MinBackoff: 1, MaxBackoff: 1}
		var p *consumer.Processor
		var err error
		if batch {
			p, err = consumer.NewBatch(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, ms []consumer.Message) error {
				for _, m := range ms {
					// The batch's transaction runs once for all: only
					// retried messages run under their own context.
					if len(ms) > 1 {
						ctx = context.WithValue(ctx, spanKey{}, m.Offset)
					}
					if err := handle(ctx, tx, m); err != nil {
						return err
					}
				}
				return nil
			}, cfg)
		} else {
			p, err = consumer.New(b.pool, "ledger", handle, cfg)
		}
		if err != nil {
			t.Fatal(err)
		}
		tm := &memTransport{}
		run(t, p, tm, msg(0, "id-0", "k"), msg(1, "id-0", "k"), msg(2, "id-2", "k"), msg(3, "id-3", "k"))

		tr.mu.Lock()
		started, ended := tr.started, len(tr.ends)
		tr.mu.Unlock()
		if started != ended {
			t.Errorf("TraceStart %d times, TraceEnd %d times", started, ended)
		}
		if e, _ := tr.end(0); e.Outcome != consumer.Processed || e.Message.ID != "id-0" || e.Consumer != "ledger" {
			t.Errorf("offset 0 ended %+v, want processed id-0", e)
		}
		if e, _ := tr.end(1); e.Outcome != consumer.Duplicate {
			t.Errorf("offset 1 ended %v, want duplicate", e.Outcome)
		}
		if e, _ := tr.end(2); e.Outcome != consumer.Processed {
			t.Errorf("offset 2 ended %v, want processed", e.Outcome)
		} else if !batch && e.Attempts != 2 {
			t.Errorf("offset 2 attempts = %d, want 2", e.Attempts)
		}
		tr.mu.Lock()
		retried := tr.retries[2]
		tr.mu.Unlock()
		if !batch && retried != 1 {
			t.Errorf("offset 2 TraceRetry %d times, want 1", retried)
		}
		e, _ := tr.end(3)
		if e.Outcome != consumer.DeadLettered || e.DeadLetterTopic != "orders.dlq" || e.Err == nil {
			t.Errorf("offset 3 ended %+v, want dead-lettered to orders.dlq with its error", e)
		}
	})
}

// timingTracer records when each message's trace started and ended.
type timingTracer struct {
	mu         sync.Mutex
	start, end map[int64]time.Time
	outcome    map[int64]consumer.Outcome
}

func (tr *timingTracer) TraceStart(ctx context.Context, e consumer.TraceStartEvent) context.Context {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.start[e.Message.Offset] = time.Now()
	return ctx
}

func (tr *timingTracer) TraceRetry(context.Context, consumer.RetryEvent) {}

func (tr *timingTracer) TraceEnd(_ context.Context, e consumer.TraceEndEvent) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.end[e.Message.Offset] = time.Now()
	tr.outcome[e.Message.Offset] = e.Outcome
}

// In batch mode each message's trace covers the batch's transaction: it
// starts before the transaction and ends after its commit, so a consumer
// span lasts at least as long as the handler that processed the message.
func TestBatchTraceCoversTheBatchTransaction(t *testing.T) {
	b := setup(t)
	tr := &timingTracer{start: map[int64]time.Time{}, end: map[int64]time.Time{}, outcome: map[int64]consumer.Outcome{}}
	const work = 100 * time.Millisecond
	type span struct{ from, to time.Time }
	var mu sync.Mutex
	handled := map[int64]span{} // offset -> its batch handler's run
	p, err := consumer.NewBatch(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, ms []consumer.Message) error {
		from := time.Now()
		time.Sleep(work) // the handler's work, of known length
		for _, m := range ms {
			if err := b.record(ctx, tx, "ledger", m); err != nil {
				return err
			}
		}
		to := time.Now()
		mu.Lock()
		defer mu.Unlock()
		for _, m := range ms {
			handled[m.Offset] = span{from, to}
		}
		return nil
	}, &consumer.Config{Schema: b.schema, Hooks: []consumer.Hook{tr}})
	if err != nil {
		t.Fatal(err)
	}
	run(t, p, &memTransport{}, msg(0, "id-0", "k"), msg(1, "id-1", "k"), msg(2, "id-0", "k"), msg(3, "id-3", "k"))

	tr.mu.Lock()
	defer tr.mu.Unlock()
	mu.Lock()
	defer mu.Unlock()
	for off := range int64(4) {
		start, end := tr.start[off], tr.end[off]
		if start.IsZero() || end.IsZero() {
			t.Fatalf("offset %d: trace started %v, ended %v", off, start, end)
		}
		if d := end.Sub(start); d < work {
			t.Errorf("offset %d: trace lasted %s, less than its batch's handler (%s)", off, d, work)
		}
		h, ok := handled[off]
		covers := func(h span) bool { return !start.After(h.from) && !end.Before(h.to) }
		if off == 2 {
			// A duplicate of offset 0: the handler never sees it. Its trace
			// covers the batch it came in, with offset 0 or (on a slow
			// machine, a batch of its own with offset 3) with offset 3.
			h, ok = handled[0]
			if h3, ok3 := handled[3]; ok && !covers(h) && ok3 {
				h = h3
			}
		}
		if !ok || !covers(h) {
			t.Errorf("offset %d: trace %s..%s does not cover its batch's handler %s..%s",
				off, start.Format(time.StampMicro), end.Format(time.StampMicro), h.from.Format(time.StampMicro), h.to.Format(time.StampMicro))
		}
	}
	if tr.outcome[2] != consumer.Duplicate || tr.outcome[0] != consumer.Processed {
		t.Errorf("outcomes %v, want offset 0 processed and 2 duplicate", tr.outcome)
	}
}
