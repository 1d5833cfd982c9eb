package kgopublisher

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/relay"
)

// The publisher refuses a record for its size only where the client would:
// around the limit, every record minBatchBytes puts over it is one the
// client refuses, and the records it lets through that the client then
// refuses lie within nearLimit of the limit (their key's later records
// are held).
func TestMinBatchBytesNeverRefusesWhatTheClientSends(t *testing.T) {
	t.Parallel()
	k := kafkatest.New(t)
	topic := k.Topic(t, 1)
	const limit = 1024
	cl := k.Client(t, kgo.ProducerBatchMaxBytes(limit), kgo.DefaultProduceTopic(topic))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	shapes := []struct {
		key     []byte
		headers []relay.Header
	}{
		{nil, nil},
		{[]byte("k"), nil},
		{[]byte("a-longer-key-of-some-bytes"), []relay.Header{{Key: relay.MessageIDHeader, Value: []byte("0b5e4a3c-2f9d-4c1e-8a7b-6d5f4e3c2b1a")}}},
	}
	slack := 0
	for _, shape := range shapes {
		for n := 880; n <= 1000; n++ {
			rec := relay.Record{Topic: topic, Key: shape.key, Value: bytes.Repeat([]byte("v"), n), Headers: shape.headers}
			kr := &kgo.Record{Key: rec.Key, Value: rec.Value}
			for _, h := range rec.Headers {
				kr.Headers = append(kr.Headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
			}
			err := cl.ProduceSync(ctx, kr).FirstErr()
			if err != nil && !errors.Is(err, kerr.MessageTooLarge) {
				t.Fatalf("value of %d bytes: %v", n, err)
			}
			refused, over := err != nil, minBatchBytes(&rec) > limit
			if over && !refused {
				t.Fatalf("key %q, %d headers, value of %d bytes: minBatchBytes %d is over the limit %d, yet the client sent it",
					shape.key, len(shape.headers), n, minBatchBytes(&rec), limit)
			}
			if refused && !over {
				slack = max(slack, limit-minBatchBytes(&rec)+1)
				t.Logf("refused by the client at minBatchBytes %d: key %q, %d headers, value %d", minBatchBytes(&rec), shape.key, len(shape.headers), n)
			}
		}
	}
	t.Logf("records the client refused that minBatchBytes let through: within %d bytes of the limit", slack)
	if slack >= nearLimit {
		t.Fatalf("minBatchBytes counts %d bytes short of the client, nearLimit only %d: a record the client refuses could let its key's later records out", slack, nearLimit)
	}
}

// A record the client may still count over its limit (within nearLimit of
// it) is produced, but its key's later record in the call is not sent:
// were the record refused, the later one would otherwise be acknowledged
// ahead of its dead letter (G3).
func TestARecordAtTheLimitHoldsItsKeysLaterRecords(t *testing.T) {
	t.Parallel()
	k := kafkatest.New(t)
	topic := k.Topic(t, 1)
	const limit = 1024
	p := NewFromClient(k.Client(t, kgo.ProducerBatchMaxBytes(limit)))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Learn the produce version first, as a running relay has.
	if errs := p.Publish(ctx, []relay.Record{{Topic: topic, Key: []byte("warm"), Value: []byte("x")}}); errs[0] != nil {
		t.Fatal(errs[0])
	}
	for _, n := range []int{953, 940} { // refused by the client; sent
		rec := relay.Record{Topic: topic, Key: []byte("k"), Value: bytes.Repeat([]byte("v"), n)}
		if size := minBatchBytes(&rec); size > limit || size <= limit-nearLimit {
			t.Fatalf("minBatchBytes %d: not within %d bytes under the limit %d", size, nearLimit, limit)
		}
		errs := p.Publish(ctx, []relay.Record{rec, {Topic: topic, Key: []byte("k"), Value: []byte("later")}, {Topic: topic, Key: []byte("other"), Value: []byte("o")}})
		t.Logf("value of %d bytes: %v", n, errs)
		if !errors.Is(errs[1], relay.ErrNotSent) {
			t.Fatalf("the key's later record: %v, want ErrNotSent", errs[1])
		}
		if errs[2] != nil {
			t.Fatalf("another key's record: %v", errs[2])
		}
	}
}

// The limit is the client's for the record's topic
// (kgo.ProducerBatchMaxBytesFn), not its default's: a record the client
// sends to its topic is not refused (and dead-lettered) for another
// topic's limit.
func TestTheLimitIsTheClientsForTheTopic(t *testing.T) {
	t.Parallel()
	k := kafkatest.New(t)
	topic := k.Topic(t, 1)
	cl := k.Client(t, kgo.ProducerBatchMaxBytesFn(func(tp string) int32 {
		if tp == topic {
			return 64 << 10
		}
		return 1024
	}))
	p := NewFromClient(cl)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if errs := p.Publish(ctx, []relay.Record{{Topic: topic, Key: []byte("k"), Value: bytes.Repeat([]byte("v"), 4000)}}); errs[0] != nil {
		t.Fatalf("a 4000-byte record to a topic whose client limit is 64 KiB: %v", errs[0])
	}
}

// The limit is also what the client's BrokerMaxWriteBytes leaves a batch
// in a produce request: a record over it is refused up front and its key's
// later record not sent, not acknowledged in the same call while the
// client refuses the first (G3).
func TestTheLimitIsWhatARequestLeavesTheBatch(t *testing.T) {
	t.Parallel()
	k := kafkatest.New(t)
	topic := k.Topic(t, 1)
	cl := k.Client(t, kgo.BrokerMaxWriteBytes(4096), kgo.ProducerBatchMaxBytesFn(func(tp string) int32 {
		if tp == topic {
			return 1 << 20
		}
		return 1024
	}))
	p := NewFromClient(cl)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, n := range []int{5000, 3960} { // over the room a request leaves; near it
		errs := p.Publish(ctx, []relay.Record{
			{Topic: topic, Key: []byte("k"), Value: bytes.Repeat([]byte("v"), n)},
			{Topic: topic, Key: []byte("k"), Value: []byte("later")},
		})
		t.Logf("value of %d bytes: %v", n, errs)
		if errs[0] != nil && !errors.Is(errs[0], relay.ErrRecordTooLarge) {
			t.Fatalf("first: %v, want ErrRecordTooLarge", errs[0])
		}
		if !errors.Is(errs[1], relay.ErrNotSent) {
			t.Fatalf("the key's later record: %v, want ErrNotSent", errs[1])
		}
	}
}
