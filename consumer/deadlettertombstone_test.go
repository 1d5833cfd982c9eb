package consumer_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

// A compacted dead-letter topic (the case the shrink keeps keys and empty
// values for): a dead letter with a null value is a tombstone there. A
// handler that fails on a tombstone of the consumed (compacted) topic gets
// a dead letter with a null value; compaction then deletes the key's
// earlier dead letters (values included) and, after delete.retention.ms,
// the dead letter itself. Also on the shrink path: the value step is
// skipped for a value that is already empty, leaving it null (cold review,
// helper 67). The dead letter's value is empty instead, and
// HeaderDLQTombstone says the original's was null, for a replay to restore.
func TestDeadLetterOfATombstoneIsNotATombstone(t *testing.T) {
	b := setup(t)
	p, err := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return consumer.Permanent(errors.New("cannot apply"))
	}, &consumer.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	first := msg(0, "id-0", "acct-1") // value "v0"
	tomb := msg(1, "id-1", "acct-1")
	tomb.Value = nil // a tombstone of the consumed compacted topic
	tr := &compactedTransport{sizeLimitedTransport{limit: 1 << 20}}
	w := start(t, p, tr, first, tomb)
	defer w.Stop(context.Background())
	deadline := time.Now().Add(5 * time.Second)
	for tr.lastMark() != 1 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	dls := tr.deadLetters()
	if len(dls) != 2 {
		t.Fatalf("%d dead letters, want 2", len(dls))
	}
	for _, d := range dls {
		tombstone := ""
		for _, h := range d.Headers {
			if h.Key == consumer.HeaderDLQTombstone {
				tombstone = string(h.Value)
			}
		}
		if want := map[int64]string{0: "", 1: "true"}[d.Message.Offset]; tombstone != want {
			t.Errorf("dead letter of offset %d: %s header %q, want %q", d.Message.Offset, consumer.HeaderDLQTombstone, tombstone, want)
		}
		if d.Value == nil {
			t.Errorf("dead letter of offset %d (key %q) has a null value: a tombstone on a compacted dead-letter topic, which deletes the key's earlier dead letter (value %q) and then itself",
				d.Message.Offset, d.Key, dls[0].Value)
		}
	}
}
