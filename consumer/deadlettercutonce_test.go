package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

// countingTooLarge refuses every dead letter as too large for its topic (a
// dead-letter topic whose max.message.bytes is below even the smallest
// dead letter) and counts the attempts and the error header's size.
type countingTooLarge struct {
	memTransport
	calls      atomic.Int64
	mu         sync.Mutex
	errHeaders []int
}

func (c *countingTooLarge) PublishDeadLetter(_ context.Context, d consumer.DeadLetter) error {
	c.calls.Add(1)
	c.mu.Lock()
	for _, h := range d.Headers {
		if h.Key == consumer.HeaderDLQError && len(c.errHeaders) < 8 {
			c.errHeaders = append(c.errHeaders, len(h.Value))
		}
	}
	c.mu.Unlock()
	return fmt.Errorf("publish dead letter: %w", consumer.ErrDeadLetterTooLarge)
}

type errorLines struct {
	mu    sync.Mutex
	n     int
	lines map[string]int
}

func (e *errorLines) Enabled(context.Context, slog.Level) bool { return true }
func (e *errorLines) Handle(_ context.Context, r slog.Record) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if r.Level >= slog.LevelError {
		e.n++
		if e.lines == nil {
			e.lines = map[string]int{}
		}
		e.lines[r.Message]++
	}
	return nil
}
func (e *errorLines) WithAttrs([]slog.Attr) slog.Handler { return e }
func (e *errorLines) WithGroup(string) slog.Handler      { return e }

// Once every shrink step has run and the dead letter still does
// not fit, the Processor must back off and log "even at its smallest" at
// Error. But the error-header cut leaves 256 bytes + "... (cut to fit the
// topic)" = 282 bytes, which is again > 256, so shrinkDeadLetter "cuts" it
// again on every call and reports progress for ever: the loop `continue`s
// without backoff, publishing and logging at Error as fast as it can.
func TestDeadLetterCutOnceThenBacksOff(t *testing.T) {
	b := setup(t)
	long := strings.Repeat("x", 2000)
	logs := &errorLines{}
	p, err := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return consumer.Permanent(errors.New("cannot handle: " + long))
	}, &consumer.Config{Schema: b.schema, Logger: slog.New(logs)})
	if err != nil {
		t.Fatal(err)
	}
	tr := &countingTooLarge{}
	w := start(t, p, tr, msg(0, "id-0", "k"))
	time.Sleep(time.Second)
	calls := tr.calls.Load()
	stopCtx, cancelStop := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancelStop()
	stopStart := time.Now()
	w.Stop(stopCtx) // a graceful stop (rebalance, shutdown): the backoff sleep watches stop
	stopTook := time.Since(stopStart)

	logs.mu.Lock()
	smallest := logs.lines["consumer: dead letter too large for its topic even at its smallest; the partition waits until the topic's max.message.bytes is raised"]
	cuts := logs.lines["consumer: dead letter too large for its topic; publishing it without its error text past the first 256 bytes"]
	logs.mu.Unlock()
	tr.mu.Lock()
	sizes := tr.errHeaders
	tr.mu.Unlock()
	t.Logf("stop took %s; in 1s: %d publish attempts, %d Error lines \"without its error text\", %d \"even at its smallest\"; error header sizes %v",
		stopTook.Round(time.Millisecond), calls, cuts, smallest, sizes)
	// With MinBackoff 100ms, one second allows the initial attempt, three
	// shrink steps and ~10 backed-off retries.
	if calls > 50 {
		t.Errorf("%d dead-letter publishes in one second: the shrink step never reports \"nothing left\" and the loop skips its backoff", calls)
	}
	if cuts > 1 {
		t.Errorf("the error header was \"cut to 256 bytes\" %d times: a cut header (282 bytes) is cut again", cuts)
	}
	if stopTook > time.Second {
		t.Errorf("Partition.Stop took %s (its ctx's whole timeout): the loop never reaches the sleep that watches stop", stopTook.Round(time.Millisecond))
	}
	if smallest == 0 {
		t.Errorf("never logged \"too large even at its smallest\"")
	}
}
