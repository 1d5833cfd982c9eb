package consumer_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

// A message whose message-id header is
// unusable because it is huge (a producer that put a payload there) is
// dead-lettered at once. Every shrink step keeps the message-id header, so a
// dead letter whose id header alone exceeds the dead-letter topic's limit
// never fits, and the partition waits for good (G6) although the header
// that does not fit is the very one that made the message unusable.
func TestDeadLetterHugeUnusableIDFits(t *testing.T) {
	b := setup(t)
	p, err := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	bad := msg(0, "", "k")
	bad.Headers = []consumer.Header{{Key: consumer.MessageIDHeader, Value: bytes.Repeat([]byte("i"), 20_000)}}
	tr := &sizeLimitedTransport{limit: 12_000}
	w := start(t, p, tr, bad, msg(1, "id-1", "k"))
	defer w.Stop(context.Background())
	deadline := time.Now().Add(5 * time.Second)
	for tr.lastMark() != 1 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if tr.lastMark() != 1 {
		t.Fatalf("partition stuck: last mark %d after 5s; dead letters %d (the 20 KB unusable id header is kept by every shrink step)",
			tr.lastMark(), len(tr.deadLetters()))
	}
}
