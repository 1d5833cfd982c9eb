package consumer_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/onceflow/onceflow/consumer"
)

// compactedTransport is a compacted dead-letter topic with a small
// max.message.bytes, as Kafka checks it: the size first (UnifiedLog's
// analyzeAndValidateRecords: RECORD_TOO_LARGE), then the key (LogValidator:
// "Compacted topic cannot accept message without key", INVALID_RECORD,
// which kgoconsumer returns unwrapped, as a passing error).
type compactedTransport struct {
	sizeLimitedTransport
}

func (c *compactedTransport) PublishDeadLetter(ctx context.Context, d consumer.DeadLetter) error {
	if err := c.refuseSize(d); err != nil {
		return err
	}
	if d.Key == nil {
		return fmt.Errorf("kgoconsumer: publish dead letter to %s: %w", d.Topic, kerr.InvalidRecord)
	}
	return c.memTransport.PublishDeadLetter(ctx, d)
}

// The shrink keeps the value empty rather than null because a compacted
// topic takes a null value for a tombstone; it drops the key to null, which
// a compacted topic refuses outright. A dead letter of a keyed message
// (a compacted consumed topic has keys) that needs the error cut to fit
// then never goes out: the partition waits for good (G6), logged at Warn.
func TestDeadLetterShrinkKeepsAKeyForCompactedTopics(t *testing.T) {
	b := setup(t)
	p, err := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if m.Offset == 0 {
			return consumer.Permanent(errors.New(strings.Repeat("r", 2000)))
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	big := msg(0, "id-0", strings.Repeat("k", 100))
	big.Value = bytes.Repeat([]byte("v"), 5000)
	tr := &compactedTransport{sizeLimitedTransport{limit: 1000}}
	w := start(t, p, tr, big, msg(1, "id-1", "k2"))
	defer w.Stop(context.Background())
	deadline := time.Now().Add(5 * time.Second)
	for tr.lastMark() != 1 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if tr.lastMark() != 1 {
		t.Fatalf("partition stuck after 5s (last mark %d, dead letters %d): the shrink made the key null, which a compacted dead-letter topic refuses",
			tr.lastMark(), len(tr.deadLetters()))
	}
}
