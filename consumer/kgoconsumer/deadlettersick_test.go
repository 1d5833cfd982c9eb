package kgoconsumer_test

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// TestSickDeadLetterPartitionDoesNotStallHealthyOnes: the dead-letter topic has two partitions; partition 0's
// produces fail with NOT_ENOUGH_REPLICAS (its ISR shrank below
// min.insync.replicas), partition 1 is healthy. A message of source
// partition 0 (key routed to dead-letter partition 0) is dead-lettered
// first, then one of source partition 1 (key routed to dead-letter
// partition 1). The healthy one must go out at once, not wait behind the
// sick one's publish, which franz-go retries for kgo.RecordDeliveryTimeout
// (30 s), and again behind each retry of it: one dead letter at a time per
// topic had a single unavailable dead-letter partition stall every
// partition that dead-letters to the topic.
func TestSickDeadLetterPartitionDoesNotStallHealthyOnes(t *testing.T) {
	k := kafkatest.New(t)
	fake := k.RequireFake(t)
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	topic := "sick-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	dlq := topic + ".dlq"
	k.CreateTopic(t, topic, 2, nil)
	k.CreateTopic(t, dlq, 2, nil)
	details, err := k.Admin(t).ListTopics(context.Background(), dlq)
	if err != nil {
		t.Fatal(err)
	}
	dlqID := details[dlq].ID

	// Keys that the default partitioner (murmur2 of the key) sends to
	// the dead-letter topic's partitions 0 and 1.
	part := kgo.StickyKeyPartitioner(nil).ForTopic(dlq)
	keyFor := map[int]string{}
	for i := 0; len(keyFor) < 2; i++ {
		key := "k" + strconv.Itoa(i)
		p := part.Partition(&kgo.Record{Key: []byte(key)}, 2)
		if _, ok := keyFor[p]; !ok {
			keyFor[p] = key
		}
	}

	fake.ControlKey(int16(kmsg.Produce), func(kr kmsg.Request) (kmsg.Response, error, bool) {
		fake.KeepControl()
		req := kr.(*kmsg.ProduceRequest)
		sick := false
		for _, rt := range req.Topics {
			if rt.Topic != dlq && rt.TopicID != dlqID {
				continue
			}
			for _, rp := range rt.Partitions {
				if rp.Partition == 0 {
					sick = true
				}
			}
		}
		if !sick {
			return nil, nil, false
		}
		resp := req.ResponseKind().(*kmsg.ProduceResponse)
		for _, rt := range req.Topics {
			st := kmsg.NewProduceResponseTopic()
			st.Topic, st.TopicID = rt.Topic, rt.TopicID
			for _, rp := range rt.Partitions {
				sp := kmsg.NewProduceResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.ErrorCode = kerr.NotEnoughReplicas.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})

	cl := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	for p := range int32(2) {
		if err := cl.ProduceSync(context.Background(), &kgo.Record{Topic: topic, Partition: p, Key: []byte(keyFor[int(p)]), Value: []byte("v"),
			Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte(strconv.Itoa(int(p)))}}}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	var firstFailed atomic.Bool
	proc, err := consumer.New(pool, "sick", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if m.Partition == 1 {
			// Fail after partition 0's dead letter is under way.
			for !firstFailed.Load() {
				time.Sleep(10 * time.Millisecond)
			}
			time.Sleep(500 * time.Millisecond)
		} else {
			firstFailed.Store(true)
		}
		return consumer.Permanent(errors.New("cannot apply"))
	}, &consumer.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	c, err := kgoconsumer.New(proc, &kgoconsumer.Config{
		Brokers: k.Brokers, Topics: []string{topic}, Group: "g",
		CommitInterval: 100 * time.Millisecond,
		ClientOpts:     []kgo.Opt{kgo.FetchMaxWait(200 * time.Millisecond)},
	})
	if err != nil {
		t.Fatal(err)
	}
	runInBackground(t, c)
	start := time.Now()
	dead := k.ReadAll(t, dlq, 1, 10*time.Second)
	if len(dead) != 1 {
		t.Fatalf("the healthy dead-letter partition holds %d records %s after start, want 1: the dead letter of source partition 1 waits its turn behind partition 0's, which its partition refuses", len(dead), time.Since(start).Round(time.Second))
	}
	if string(dead[0].Key) != keyFor[1] {
		t.Fatalf("dead letter key %q, want %q", dead[0].Key, keyFor[1])
	}
}
