package kafkagoconsumer_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kafkagoconsumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// TestCompactedBatchTailDoesNotStallThePartition (cold review, helper 96):
// on a compacted topic the log cleaner removes superseded records from a
// batch but keeps the batch's last offset (Kafka keeps it for the
// producer's sequence numbers). A batch [k1@0 k2@1 k3@2] whose k3 was
// written again later is kept as [k1@0 k2@1] with last offset 2, and it is
// the last batch of its segment; a fetch answers from one segment only. A
// consumer at offset 2 is answered with that batch again and again: it
// must move past the batch's last offset, as franz-go does. The kafka-go
// adapter's fetcher moves its offset only past the records it reads, so
// the partition refetches offset 2 for ever and nothing after it (k3@3,
// k4@4, k5@5, k6@6) is ever processed, with no error logged (observed:
// [0 1] processed in 30 s; kgoconsumer: all six at once). A new group reading
// a compacted topic from its start (rebuilding state: what compaction is
// for) meets it at every segment whose last batch lost its tail.
//
// Needs a real broker (kfake does not compact); make test-kafka.
func TestCompactedBatchTailDoesNotStallThePartition(t *testing.T) {
	if !kafkatest.Real() {
		t.Skip("needs a real broker: kfake does not compact (ONCEFLOW_TEST_KAFKA_BROKERS)")
	}
	k := kafkatest.New(t)
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	topic := "h96-compact-" + hex.EncodeToString(b)
	str := func(s string) *string { return &s }
	k.CreateTopic(t, topic, 1, map[string]*string{
		"cleanup.policy":            str("compact"),
		"segment.bytes":             str("1048576"), // Kafka 4's least
		"min.cleanable.dirty.ratio": str("0.01"),
		"min.compaction.lag.ms":     str("0"),
		"max.message.bytes":         str("8388608"),
	})
	// 300 KiB values: the first batch (three records, 900 KiB) fills a
	// segment of its own (a batch must fit a segment), and the cleaner
	// does not merge it with the next (900 KiB too).
	big := func(c byte) []byte { return bytes.Repeat([]byte{c}, 300<<10) }
	cl := k.Client(t, kgo.ProducerLinger(200*time.Millisecond), kgo.ProducerBatchMaxBytes(8<<20),
		kgo.MaxBufferedBytes(64<<20), kgo.ProducerBatchCompression(kgo.NoCompression()))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// One batch: k1@0, k2@1, k3@2.
	if err := cl.ProduceSync(ctx,
		&kgo.Record{Topic: topic, Key: []byte("k1"), Value: big('1')},
		&kgo.Record{Topic: topic, Key: []byte("k2"), Value: big('2')},
		&kgo.Record{Topic: topic, Key: []byte("k3"), Value: big('3')},
	).FirstErr(); err != nil {
		t.Fatal(err)
	}
	// k3 again @3, then k4 @4, k5 @5 and k6 @6, each a batch: @3-@5 fill
	// a second segment, and @6 rolls a third, so the first two can be
	// cleaned.
	for _, key := range []string{"k3", "k4", "k5", "k6"} {
		if err := cl.ProduceSync(ctx, &kgo.Record{Topic: topic, Key: []byte(key), Value: big(key[1])}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	// Wait for the cleaner (log.cleaner.backoff.ms, 15 s by default) to
	// remove k3@2.
	deadline := time.Now().Add(150 * time.Second)
	for {
		var offs []int64
		for _, r := range k.ReadAll(t, topic, 7, 4*time.Second) {
			offs = append(offs, r.Offset)
		}
		if !slices.Contains(offs, 2) && slices.Contains(offs, 3) {
			t.Logf("compacted: offsets %v", offs)
			break
		}
		if time.Now().After(deadline) {
			t.Skipf("the log cleaner did not remove k3@2 within 150s (offsets %v)", offs)
		}
		time.Sleep(2 * time.Second)
	}

	for _, adapter := range []string{"kgoconsumer", "kafkagoconsumer"} {
		t.Run(adapter, func(t *testing.T) {
			if got, want := consumeOffsets(t, k, topic, adapter, 6), []int64{0, 1, 3, 4, 5, 6}; !slices.Equal(got, want) {
				t.Errorf("%s processed offsets %v of the compacted partition within 30s, want %v: it stalled after the batch whose tail compaction removed",
					adapter, got, want)
			}
		})
	}
}

// consumeOffsets runs adapter on topic's one partition from its start
// until n messages were processed or 30s passed, and returns the offsets
// processed, in order.
func consumeOffsets(t *testing.T, k *kafkatest.Kafka, topic, adapter string, n int) []int64 {
	t.Helper()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := pool.Exec(context.Background(), `CREATE TABLE `+effects+` (off bigint)`); err != nil {
		t.Fatal(err)
	}
	p, err := consumer.New(pool, "h96", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+effects+` VALUES ($1)`, m.Offset)
		return err
	}, &consumer.Config{Schema: schema, MessageID: func(m consumer.Message) (string, error) {
		return fmt.Sprintf("%s/%d/%d", m.Topic, m.Partition, m.Offset), nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	group := "h96-" + adapter + "-" + topic
	var run interface{ Run(context.Context) error }
	if adapter == "kgoconsumer" {
		run, err = kgoconsumer.New(p, &kgoconsumer.Config{Brokers: k.Brokers, Topics: []string{topic}, Group: group})
	} else {
		run, err = kafkagoconsumer.New(p, &kafkagoconsumer.Config{Reader: kafka.ReaderConfig{
			Brokers: k.Brokers, GroupID: group, GroupTopics: []string{topic}, MaxWait: 200 * time.Millisecond,
		}})
	}
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run.Run(rctx) }()
	defer func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	var got []int64
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		got = got[:0]
		rows, err := pool.Query(context.Background(), `SELECT off FROM `+effects+` ORDER BY off`)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var o int64
			_ = rows.Scan(&o)
			got = append(got, o)
		}
		rows.Close()
		if len(got) >= n {
			break
		}
	}
	return got
}
