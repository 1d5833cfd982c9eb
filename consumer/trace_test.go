package consumer_test

import (
	"context"
	"errors"
	"sync"
	"testing"

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
	for _, batch := range []bool{false, true} {
		name := "per-message"
		if batch {
			name = "batch"
		}
		t.Run(name, func(t *testing.T) {
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
}
