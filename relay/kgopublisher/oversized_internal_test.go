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
// refuses lie within a few bytes of the limit.
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
	if slack > 16 {
		t.Fatalf("minBatchBytes counts %d bytes short of the client: records that close to the limit get through to be refused by the client alone", slack)
	}
}
