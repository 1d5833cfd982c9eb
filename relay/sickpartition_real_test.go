package relay_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
)

// TestSickPartitionCostsOnlyItsKeys on Apache Kafka itself, with no fault
// injected: the sick topic's partition has two replicas, one on a broker
// that is fenced, and min.insync.replicas=2, so its ISR is below the minimum
// and the broker answers every acks=all produce to it with
// NOT_ENOUGH_REPLICAS (retriable). (Replication factor 1 with
// min.insync.replicas=2 does not do it: Kafka caps the minimum at the
// replica count.)
// Every other key is published promptly, the sick event is held in the
// outbox (never dead-lettered, G7) and goes out once min.insync.replicas is
// lowered to 1. Both publishers. `make test-kafka` runs it.
func TestSickPartitionOnARealBrokerCostsOnlyItsKeys(t *testing.T) {
	if !kafkatest.Real() {
		t.Skip("needs the real Apache Kafka broker of scripts/kafka.sh (make test-kafka): the sick partition is a topic below min.insync.replicas, which kfake does not enforce; make test runs TestSickPartitionCostsOnlyItsKeys on kfake's fault injection instead")
	}
	publishers := map[string]func(b *bundle, t *testing.T) relay.Publisher{
		"franz-go": func(b *bundle, t *testing.T) relay.Publisher { return b.publisher(t) },
		"kafka-go": func(b *bundle, t *testing.T) relay.Publisher {
			pub, err := kafkagopublisher.New(b.kafka.Brokers, nil)
			if err != nil {
				t.Fatal(err)
			}
			return pub
		},
	}
	// A broker of the test's own: its cluster gets a second, fenced broker.
	broker := kafkatest.NewBroker(t)
	peer := broker.FencedPeer(t)
	for _, name := range []string{"franz-go", "kafka-go"} {
		t.Run(name, func(t *testing.T) {
			b := setup(t)
			b.kafka = &broker.Kafka
			runSickPartitionOnARealBroker(t, b, publishers[name](b, t), peer)
		})
	}
}

func runSickPartitionOnARealBroker(t *testing.T, b *bundle, pub relay.Publisher, peer int32) {
	sick := realTopicName()
	two := "2"
	// Replicas on the live broker (the leader) and the fenced one: the ISR
	// is the leader alone, below min.insync.replicas=2.
	b.kafka.CreateTopicOn(t, sick, []int32{1, peer}, map[string]*string{"min.insync.replicas": &two})
	healthy := b.kafka.Topic(t, 4)

	b.write(t, outbox.Message{Topic: sick, Key: []byte("sick"), Value: []byte("held")})
	const n = 2000
	msgs := make([]outbox.Message, 0, n)
	for i := range n {
		msgs = append(msgs, outbox.Message{Topic: healthy, Key: []byte(fmt.Sprint("k", i%97)), Value: []byte(fmt.Sprint(i))})
	}
	b.write(t, msgs...)
	outboxTable := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	want := map[string]bool{}
	rows, err := b.pool.Query(context.Background(), `SELECT event_id::text FROM `+outboxTable+` WHERE topic = $1`, healthy)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		want[id] = true
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(want) != n {
		t.Fatalf("%d healthy events in the outbox, wrote %d", len(want), n)
	}

	obs := &countingObserver{}
	b.startRelayWith(t, b.pool, pub, relay.Config{PublishTimeout: 2 * time.Second, Observer: obs})
	start := time.Now()
	// At least once: kafka-go's retries may write a record twice, so read
	// until every event is seen, not until n records are.
	var got []*kgo.Record
	seen := map[string]bool{}
	for len(seen) < n && time.Since(start) < 90*time.Second {
		got = b.kafka.ReadAll(t, healthy, len(got)+n-len(seen), 90*time.Second-time.Since(start))
		clear(seen)
		for _, r := range got {
			id := header(r, relay.MessageIDHeader)
			if !want[id] {
				t.Fatalf("record with message-id %q on the healthy topic was not written there", id)
			}
			seen[id] = true
		}
	}
	if len(seen) < n {
		t.Fatalf("%d of %d events of healthy keys published in 90s beside one partition below min.insync.replicas", len(seen), n)
	}
	t.Logf("%d healthy events (%d records) published in %s", len(seen), len(got), time.Since(start))

	waitFor(t, "the sick event to be retried", 60*time.Second, func() bool {
		var attempts int
		err := b.pool.QueryRow(context.Background(), `SELECT attempts FROM `+outboxTable+` WHERE topic = $1`, sick).Scan(&attempts)
		return err == nil && attempts >= 2
	})
	if d := b.count(t, "outbox_dead"); d != 0 {
		t.Fatalf("%d events dead-lettered for NOT_ENOUGH_REPLICAS, a passing broker error", d)
	}
	if obs.timedOut() == 0 {
		t.Fatal("no publish timeout was reported to the Observer")
	}
	ends, err := b.kafka.Admin(t).ListEndOffsets(context.Background(), sick)
	if err != nil {
		t.Fatal(err)
	}
	if o, ok := ends.Lookup(sick, 0); !ok || o.Err != nil || o.Offset != 0 {
		t.Fatalf("the sick topic took a record below min.insync.replicas: %+v", o)
	}

	// Heal: one in-sync replica is enough now.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	one := "1"
	resp, err := b.kafka.Admin(t).AlterTopicConfigs(ctx, []kadm.AlterConfig{{Op: kadm.SetConfig, Name: "min.insync.replicas", Value: &one}}, sick)
	if err == nil {
		_, err = resp.On(sick, func(r *kadm.AlterConfigsResponse) error { return r.Err })
	}
	if err != nil {
		t.Fatalf("lower min.insync.replicas of %s: %v", sick, err)
	}
	healed := time.Now()
	held := b.kafka.ReadAll(t, sick, 1, 90*time.Second)
	if len(held) == 0 || string(held[0].Value) != "held" {
		t.Fatalf("the held event was not published once the partition healed: %v", held)
	}
	t.Logf("held event published %s after the partition healed", time.Since(healed))
	waitFor(t, "the outbox to drain", 60*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	if d := b.count(t, "outbox_dead"); d != 0 {
		t.Fatalf("%d events dead-lettered", d)
	}
}

func realTopicName() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return "sick-" + hex.EncodeToString(b)
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}
