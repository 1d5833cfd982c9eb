package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/examples/internal/exampletest"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// examples/ledger/README.md, "Run it", before: "the topic must exist, and
// `payments.dlq` too if you want to see dead letters", then it publishes
// `not json` to show the dead letter. A reader who does not care to see
// dead letters leaves payments.dlq out; the README promises the bad message
// goes to the dead-letter topic "and the partition moves on". Without the
// dead-letter topic the partition waits instead (README.md, "Idempotent
// consumer": "While it is missing the partition waits"), so every later
// payment of the partition is never applied. h97.
func TestLedgerREADMEWithoutTheDeadLetterTopicStillAppliesLaterPayments(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	f := &fixture{schema: schema, app: schema, url: exampletest.WithSearchPath(t, pgtest.URL(t), schema), kafka: kafkatest.New(t)}
	f.topic = f.kafka.Topic(t, 1) // no <topic>.dlq: the README says it is optional
	cl := f.kafka.Client(t)

	// The README's two commands: the payment twice under one message-id,
	// then 'not json'; then one more good payment.
	f.publish(t, cl, event{"7f1d8a52-5b7e-4a37-9d7c-0d6f1c1f0c11", "a1", 250}, event{"7f1d8a52-5b7e-4a37-9d7c-0d6f1c1f0c11", "a1", 250})
	bad := &kgo.Record{Topic: f.topic, Value: []byte("not json"),
		Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte("bad-1")}}}
	if err := cl.ProduceSync(context.Background(), bad).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
	f.publish(t, cl, event{"after-bad-1", "a2", 100})

	p := f.start(t)
	p.WaitOutput(t, consuming, 30*time.Second)
	exampletest.Eventually(t, 30*time.Second, func() error {
		got := f.balances(t)
		if got["a1"] != 250 || got["a2"] != 100 {
			return fmt.Errorf("balances = %v, want a1 250 and a2 100: the payment after 'not json' was never applied (no %s.dlq topic)", got, f.topic)
		}
		return nil
	})
	p.Stop(t, 20*time.Second)
}
