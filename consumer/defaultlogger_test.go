package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/internal/proctest"
)

// missingDLQ is a transport whose dead-letter topic does not exist.
type missingDLQ struct{ memTransport }

func (m *missingDLQ) PublishDeadLetter(context.Context, consumer.DeadLetter) error {
	return fmt.Errorf("publish dead letter to orders.dlq: %w", consumer.ErrDeadLetterTopicMissing)
}

// README, "Idempotent consumer": "Create the dead-letter topic beside each
// consumed topic: onceflow never creates topics. While it is missing the
// partition waits, loudly: every failed publish is logged at Error and
// counted". The README's own quick start builds the consumer with a nil
// Config (no Logger, no Hooks): the Processor's logger then defaults to a
// discarding handler (consumer/config.go), so the partition waits in
// silence, neither logged (not even to slog.Default(), where the janitor
// and the purger log by default for this very reason) nor counted. h97.
func TestAMissingDeadLetterTopicIsLoudWithTheQuickStartsConfig(t *testing.T) {
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	logs := &proctest.Buffer{}
	old := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(logs, nil)))
	t.Cleanup(func() { slog.SetDefault(old) })

	p, err := consumer.New(pool, "ledger", func(context.Context, pgx.Tx, consumer.Message) error {
		return consumer.Permanent(errors.New("not a payment"))
	}, &consumer.Config{Schema: schema}) // the quick start's nil Config, but for the test's schema
	if err != nil {
		t.Fatal(err)
	}
	tr := &missingDLQ{}
	w := start(t, p, tr, msg(0, "id-0", "k"))
	time.Sleep(3 * time.Second)
	w.Stop(context.Background())
	if out := logs.String(); !strings.Contains(out, "level=ERROR") || !strings.Contains(out, "dead-letter topic does not exist") {
		t.Fatalf("a partition waiting on a missing dead-letter topic for 3 s logged nothing an operator can see (slog.Default got %q)", out)
	}
}
