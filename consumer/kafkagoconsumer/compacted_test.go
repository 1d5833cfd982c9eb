package kafkagoconsumer_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"hash/crc32"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kafkagoconsumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// TestCompactedBatchTailDoesNotStallThePartition: on a compacted topic
// the log cleaner removes superseded records from a batch but keeps the
// batch's last offset. A batch [a@0 b@1 c@2] whose c was written again
// later is kept as [a@0 b@1] with last offset 2, and it is the last batch
// of its segment; a fetch answers from one segment only, so a consumer at
// offset 2 is answered with that batch again and again, and must move past
// its last offset, which kafka-go does not expose. The kafka-go adapter's
// fetcher moved its offset only past the records it read, and stalled
// there for good, logging nothing (cold review, helper 96: [0 1] processed
// in 30 s; kgoconsumer: all). A new group reading a compacted topic from
// its start (rebuilding state: what compaction is for) meets it at every
// segment whose last batch lost its tail; here two in a row, the first
// 500 offsets long.
//
// Needs a real broker (kfake does not compact; see
// TestCompactedBatchesArePassedWithoutSkippingARecord); make test-kafka.
func TestCompactedBatchTailDoesNotStallThePartition(t *testing.T) {
	if !kafkatest.Real() {
		t.Skip("needs a real broker: kfake does not compact (ONCEFLOW_TEST_KAFKA_BROKERS)")
	}
	k := kafkatest.New(t)
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	topic := "compacted-" + hex.EncodeToString(b)
	str := func(s string) *string { return &s }
	k.CreateTopic(t, topic, 1, map[string]*string{
		"cleanup.policy":            str("compact"),
		"segment.bytes":             str("1048576"), // Kafka 4's least
		"min.cleanable.dirty.ratio": str("0.01"),
		"min.compaction.lag.ms":     str("0"),
		"max.message.bytes":         str("8388608"),
	})
	// 300 KiB values: a batch of three (900 KiB) fills a segment of its
	// own (a batch must fit a segment), and the cleaner does not merge two
	// such segments (600 KiB each once cleaned).
	big := func(c byte) []byte { return bytes.Repeat([]byte{c}, 300<<10) }
	cl := k.Client(t, kgo.ProducerLinger(200*time.Millisecond), kgo.ProducerBatchMaxBytes(8<<20),
		kgo.MaxBufferedBytes(64<<20), kgo.ProducerBatchCompression(kgo.NoCompression()))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	small := func(i int) *kgo.Record {
		return &kgo.Record{Topic: topic, Key: fmt.Appendf(nil, "x%03d", i), Value: bytes.Repeat([]byte{'x'}, 600)}
	}
	produce := func(rs ...*kgo.Record) {
		t.Helper()
		if err := cl.ProduceSync(ctx, rs...).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	rec := func(key byte) *kgo.Record { return &kgo.Record{Topic: topic, Key: []byte{key}, Value: big(key)} }
	// Two batches, each a segment of its own: a@0 b@1 x000@2 ... x499@501,
	// then d@502 e@503 f@504.
	first := []*kgo.Record{rec('a'), rec('b')}
	for i := range 500 {
		first = append(first, small(i))
	}
	produce(first...)
	produce(rec('d'), rec('e'), rec('f'))
	// x000..x499 again @505..@1004, f @1005, g @1006 (together a third
	// segment), then h @1007 rolls a fourth, so the first three can be
	// cleaned: x000@2..x499@501 and f@504 go, the tails of two
	// consecutive batches (500 offsets, then one), each ending its
	// segment.
	var again []*kgo.Record
	for i := range 500 {
		again = append(again, small(i))
	}
	produce(again...)
	for _, key := range "fgh" {
		produce(rec(byte(key)))
	}
	// Wait for the cleaner (log.cleaner.backoff.ms, 15 s by default).
	deadline := time.Now().Add(150 * time.Second)
	for {
		var offs []int64
		for _, r := range k.ReadAll(t, topic, 1008, 4*time.Second) {
			offs = append(offs, r.Offset)
		}
		if !slices.Contains(offs, 2) && !slices.Contains(offs, 504) && slices.Contains(offs, 1005) {
			t.Logf("compacted: %d offsets, the first six %v", len(offs), offs[:min(6, len(offs))])
			break
		}
		if time.Now().After(deadline) {
			t.Skipf("the log cleaner did not remove x000@2 and f@504 within 150s (%d offsets)", len(offs))
		}
		time.Sleep(2 * time.Second)
	}
	want := []int64{0, 1, 502, 503}
	for o := int64(505); o <= 1007; o++ {
		want = append(want, o)
	}

	for _, adapter := range []string{"kgoconsumer", "kafkagoconsumer"} {
		t.Run(adapter, func(t *testing.T) {
			if got := consumeOffsets(t, k, topic, adapter, len(want)); !slices.Equal(got, want) {
				t.Errorf("%s processed %d offsets of the compacted partition within 30s, the first six %v, want %d, the first six %v: it stalled after a batch whose tail compaction removed",
					adapter, len(got), got[:min(6, len(got))], len(want), want[:6])
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
	p, err := consumer.New(pool, "compacted", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+effects+` VALUES ($1)`, m.Offset)
		return err
	}, &consumer.Config{Schema: schema, MessageID: func(m consumer.Message) (string, error) {
		return fmt.Sprintf("%s/%d/%d", m.Topic, m.Partition, m.Offset), nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	group := "compacted-" + adapter + "-" + topic
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

// compactedLog is a partition's log as the log cleaner leaves it: batches
// keep their first and last offsets, and hold the records that survived.
type compactedLog []compactedBatch

type compactedBatch struct {
	segment     int
	first, last int64
	records     []int64
}

// fetch answers a fetch at offset as Kafka does: from the first batch
// whose last offset is offset or more, whole batches of one segment, at
// least one, until maxBytes.
func (l compactedLog) fetch(offset int64, maxBytes int32) (raw []byte, ok bool) {
	if offset > l[len(l)-1].last+1 {
		return nil, false
	}
	for i, b := range l {
		if b.last < offset {
			continue
		}
		for _, c := range l[i:] {
			if c.segment != b.segment || (len(raw) > 0 && len(raw) >= int(maxBytes)) {
				break
			}
			raw = append(raw, c.encode()...)
		}
		break
	}
	return raw, true
}

func (b compactedBatch) encode() []byte {
	var recs []byte
	for _, o := range b.records {
		r := kmsg.Record{OffsetDelta: int32(o - b.first), Key: []byte("k"), Value: []byte(strconv.FormatInt(o, 10))}
		r.Length = int32(len(r.AppendTo(nil)) - 1) // all but the length's own byte
		recs = r.AppendTo(recs)
	}
	now := time.Now().UnixMilli()
	rb := kmsg.RecordBatch{FirstOffset: b.first, Magic: 2, LastOffsetDelta: int32(b.last - b.first),
		FirstTimestamp: now, MaxTimestamp: now, ProducerID: -1, ProducerEpoch: -1, FirstSequence: -1,
		NumRecords: int32(len(b.records)), Records: recs}
	rb.Length = int32(len(rb.AppendTo(nil)) - 12) // all after FirstOffset and Length
	raw := rb.AppendTo(nil)
	binary.BigEndian.PutUint32(raw[17:21], crc32.Checksum(raw[21:], crc32.MakeTable(crc32.Castagnoli)))
	return raw
}

// TestCompactedBatchesArePassedWithoutSkippingARecord serves a partition
// compacted as Kafka leaves it (kfake does not compact): a batch whose last
// record was cleaned at the end of its segment (the gap at a batch
// boundary), an empty batch followed by a batch that lost all but its
// first two of 1,000 records, a batch whose head was cleaned, then an
// empty batch ending a segment: several consecutive gaps. Every surviving
// record is processed, in order, none twice, and passing each gap costs a
// few fetches of one batch each.
func TestCompactedBatchesArePassedWithoutSkippingARecord(t *testing.T) {
	k := kafkatest.New(t)
	fake := k.RequireFake(t)
	topic := k.Topic(t, 1)
	log := compactedLog{
		{0, 0, 2, []int64{0, 1}},
		{1, 3, 5, nil},
		{1, 6, 1005, []int64{6, 7}},
		{2, 1006, 1006, []int64{1006}},
		{2, 1007, 1010, []int64{1009}},
		{2, 1011, 1020, nil},
		{3, 1021, 1021, []int64{1021}},
		{3, 1022, 1030, []int64{1022, 1023}},
	}
	want := []int64{0, 1, 6, 7, 1006, 1009, 1021, 1022, 1023}
	end := int64(1031)
	var mu sync.Mutex
	probes := 0
	fake.ControlKey(int16(kmsg.Fetch), func(kr kmsg.Request) (kmsg.Response, error, bool) {
		fake.KeepControl()
		req := kr.(*kmsg.FetchRequest)
		if len(req.Topics) != 1 || req.Topics[0].Topic != topic || len(req.Topics[0].Partitions) != 1 {
			return nil, nil, false
		}
		rp := req.Topics[0].Partitions[0]
		if rp.PartitionMaxBytes == 1 {
			mu.Lock()
			probes++
			mu.Unlock()
		}
		resp := req.ResponseKind().(*kmsg.FetchResponse)
		rt := kmsg.NewFetchResponseTopic()
		rt.Topic = topic
		p := kmsg.NewFetchResponseTopicPartition()
		p.HighWatermark, p.LastStableOffset = end, end
		raw, ok := log.fetch(rp.FetchOffset, rp.PartitionMaxBytes)
		switch {
		case !ok:
			p.ErrorCode = kerr.OffsetOutOfRange.Code
		case len(raw) == 0 && req.MinBytes > 0:
			time.Sleep(10 * time.Millisecond) // as if waiting for data
		}
		p.RecordBatches = raw
		rt.Partitions = append(rt.Partitions, p)
		resp.Topics = append(resp.Topics, rt)
		return resp, nil, true
	})
	got := consumeOffsets(t, k, topic, "kafkagoconsumer", len(want))
	if !slices.Equal(got, want) {
		t.Errorf("processed offsets %v, want %v", got, want)
	}
	mu.Lock()
	defer mu.Unlock()
	t.Logf("%d probing fetches", probes)
	if probes > 80 {
		t.Errorf("%d probing fetches to pass four gaps, want at most 80", probes)
	}
}
