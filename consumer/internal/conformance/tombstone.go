package conformance

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
)

// testTombstoneDeadLetters: a null value, an empty value, and an empty value
// carrying onceflow-tombstone: true (a dead letter of a tombstone replayed
// verbatim), each dead-lettered through the real adapter: the first and
// the third go out with an empty value (not null: a tombstone) and
// onceflow-tombstone: true, the second without that header. The third
// lost the header (cold review, helper 68): it is a fact about the
// original record, not a report of its latest failure.
func testTombstoneDeadLetters(t *testing.T, a Adapter) {
	e := setup(t, a)
	topic := e.k.Topic(t, 1)
	e.k.CreateTopic(t, topic+".dlq", 1, nil)
	cl := e.k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	id := func(s string) []kgo.RecordHeader {
		return []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte(s)}}
	}
	rs := []*kgo.Record{
		{Topic: topic, Key: []byte("k"), Value: nil, Headers: id("null")},
		{Topic: topic, Key: []byte("k"), Value: []byte{}, Headers: id("empty")},
		{Topic: topic, Key: []byte("k"), Value: []byte{}, Headers: append(id("replayed"), kgo.RecordHeader{Key: consumer.HeaderDLQTombstone, Value: []byte("true")})},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, rs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	p, err := consumer.New(e.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return consumer.Permanent(errors.New("cannot apply"))
	}, &consumer.Config{Schema: e.schema})
	if err != nil {
		t.Fatal(err)
	}
	r := e.startWith(t, p, Options{}, "g", topic)
	e.waitCommitted(t, "g", topic, 60*time.Second)
	if err := r.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	dead := e.k.ReadAll(t, topic+".dlq", 3, 20*time.Second)
	if len(dead) != 3 {
		t.Fatalf("dead letters = %d, want 3", len(dead))
	}
	for _, d := range dead {
		h := headerMap(d)
		t.Logf("dead letter of %s: value null=%v len=%d, %s=%q", h[consumer.MessageIDHeader], d.Value == nil, len(d.Value), consumer.HeaderDLQTombstone, h[consumer.HeaderDLQTombstone])
		want := map[string]string{"null": "true", "empty": "", "replayed": "true"}[h[consumer.MessageIDHeader]]
		if d.Value == nil {
			t.Errorf("dead letter of %s has a null value", h[consumer.MessageIDHeader])
		}
		if h[consumer.HeaderDLQTombstone] != want {
			t.Errorf("dead letter of %s: %s=%q, want %q", h[consumer.MessageIDHeader], consumer.HeaderDLQTombstone, h[consumer.HeaderDLQTombstone], want)
		}
	}
}

// headerMap is r's headers by key (the last of a repeated key).
func headerMap(r *kgo.Record) map[string]string {
	h := make(map[string]string, len(r.Headers))
	for _, x := range r.Headers {
		h[x.Key] = string(x.Value)
	}
	return h
}
