// Package relaytest holds the conformance suite every relay.Publisher must
// pass, run against kfake (or a real cluster, see internal/kafkatest).
package relaytest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/relay"
)

// NewPublisher builds the publisher under test for brokers.
type NewPublisher func(t *testing.T, brokers []string) relay.Publisher

// RunPublisherConformance checks what the relay relies on from a Publisher.
func RunPublisherConformance(t *testing.T, newPublisher NewPublisher) {
	setup := func(t *testing.T) (*kafkatest.Kafka, relay.Publisher) {
		t.Helper()
		k := kafkatest.New(t)
		p := newPublisher(t, k.Brokers)
		t.Cleanup(func() { _ = p.Close() })
		return k, p
	}
	ctx := func(t *testing.T) context.Context {
		c, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		t.Cleanup(cancel)
		return c
	}

	t.Run("OrderHeadersAndMurmur2Partitions", func(t *testing.T) {
		t.Parallel()
		k, p := setup(t)
		const partitions = 3
		topic := k.Topic(t, partitions)
		var recs []relay.Record
		for i := range 300 {
			key := fmt.Sprintf("key-%d", i%10)
			recs = append(recs, relay.Record{Topic: topic, Key: []byte(key), Value: []byte(fmt.Sprint(i)),
				Headers: []relay.Header{{Key: relay.MessageIDHeader, Value: []byte(fmt.Sprintf("id-%d", i))}, {Key: "h", Value: []byte("v")}}})
		}
		requireAllAcked(t, p.Publish(ctx(t), recs))
		got := k.ReadAll(t, topic, len(recs), 30*time.Second)
		if len(got) != len(recs) {
			t.Fatalf("read %d records, want %d", len(got), len(recs))
		}
		last := map[string]int{}
		for _, r := range got {
			var i int
			fmt.Sscan(string(r.Value), &i)
			if prev, ok := last[string(r.Key)]; ok && i <= prev {
				t.Fatalf("key %s: value %d after %d", r.Key, i, prev)
			}
			last[string(r.Key)] = i
			if want := JavaPartition(r.Key, partitions); r.Partition != want {
				t.Fatalf("key %s in partition %d, Java's murmur2 says %d", r.Key, r.Partition, want)
			}
			if len(r.Headers) != 2 || r.Headers[0].Key != relay.MessageIDHeader || string(r.Headers[0].Value) != fmt.Sprintf("id-%d", i) || string(r.Headers[1].Value) != "v" {
				t.Fatalf("headers of record %d: %+v", i, r.Headers)
			}
		}
	})

	// A record too large is refused alone: the other keys' records go
	// out, and so do its key's earlier ones. Its key's later records do
	// not, and are not refused (relay.ErrNotSent): the relay dead-letters the record, and a
	// later record of its key acknowledged before that is recorded would
	// be out of order should the dead letter be lost and the record be
	// accepted later (a larger limit; G3).
	t.Run("TooLargeCostsOnlyTheOffenderAndItsKeysLaterRecords", func(t *testing.T) {
		t.Parallel()
		k, p := setup(t)
		topic := k.Topic(t, 1)
		recs := []relay.Record{
			{Topic: topic, Key: []byte("a"), Value: []byte("before")},
			{Topic: topic, Key: []byte("a"), Value: bytes.Repeat([]byte("x"), 2<<20)},
			{Topic: topic, Key: []byte("b"), Value: []byte("other")},
			{Topic: topic, Key: []byte("a"), Value: []byte("after")},
		}
		errs := p.Publish(ctx(t), recs)
		if errs[0] != nil || errs[2] != nil {
			t.Fatalf("neighbours of an oversized record failed: %v", errs)
		}
		if !errors.Is(errs[1], relay.ErrRecordTooLarge) {
			t.Fatalf("oversized record: %v, want ErrRecordTooLarge", errs[1])
		}
		if !errors.Is(errs[3], relay.ErrNotSent) || isRefusal(errs[3]) {
			t.Fatalf("the oversized record's key's later record: %v, want relay.ErrNotSent", errs[3])
		}
		if got := k.ReadAll(t, topic, 2, 30*time.Second); len(got) < 2 {
			t.Fatalf("read %d records, want 2", len(got))
		}
		got := k.ReadAll(t, topic, 3, 3*time.Second) // a third would be "after"
		var values []string
		for _, r := range got {
			values = append(values, string(r.Value))
		}
		if len(got) != 2 || values[0] != "before" || values[1] != "other" {
			t.Fatalf("read %q, want before and other", values)
		}
	})

	t.Run("UnknownTopic", func(t *testing.T) {
		t.Parallel()
		k, p := setup(t)
		topic := k.Topic(t, 1)
		errs := p.Publish(ctx(t), []relay.Record{
			{Topic: "does-not-exist", Value: []byte("lost?")},
			{Topic: topic, Value: []byte("fine")},
		})
		if !errors.Is(errs[0], relay.ErrUnknownTopic) {
			t.Fatalf("unknown topic: %v, want ErrUnknownTopic", errs[0])
		}
		if errs[1] != nil {
			t.Fatalf("record for an existing topic failed beside an unknown one: %v", errs[1])
		}
	})

	t.Run("ForbiddenTopic", func(t *testing.T) {
		t.Parallel()
		k, p := setup(t)
		fake := k.RequireFake(t)
		topic := k.Topic(t, 1)
		fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.TopicAuthorizationFailed, Count: -1})
		errs := p.Publish(ctx(t), []relay.Record{{Topic: topic, Value: []byte("x")}})
		if !errors.Is(errs[0], relay.ErrTopicForbidden) {
			t.Fatalf("forbidden topic: %v, want ErrTopicForbidden", errs[0])
		}
	})

	t.Run("PassingErrorsAreNotRefusals", func(t *testing.T) {
		t.Parallel()
		k, p := setup(t)
		fake := k.RequireFake(t)
		topic := k.Topic(t, 1)
		h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.NotLeaderForPartition, Count: 3})
		recs := []relay.Record{{Topic: topic, Key: []byte("k"), Value: []byte("1")}, {Topic: topic, Key: []byte("k"), Value: []byte("2")}}
		acked := 0
		for try := 0; try < 10 && acked < len(recs); try++ {
			acked = 0
			for _, err := range p.Publish(ctx(t), recs) {
				if err == nil {
					acked++
				} else if isRefusal(err) {
					t.Fatalf("a passing broker error was reported as a refusal: %v", err)
				}
			}
		}
		if acked != len(recs) {
			t.Fatalf("records not acknowledged after the fault cleared")
		}
		if h.Hits() == 0 {
			t.Fatal("the injected fault was never hit; the test proves nothing")
		}
	})

	// Records of one key that do not fit one request: when the first
	// fails (after the publisher's own retries, if it has a limit), the
	// later one must fail too and must not reach Kafka ahead of it (G3).
	t.Run("FailedRecordFailsItsKeysLaterRecords", func(t *testing.T) {
		t.Parallel()
		k, p := setup(t)
		fake := k.RequireFake(t)
		topic := k.Topic(t, 1)
		h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.NotEnoughReplicas, Count: 5})
		big := func(v string) []byte { return append([]byte(v), bytes.Repeat([]byte("x"), 600<<10)...) }
		recs := []relay.Record{
			{Topic: topic, Key: []byte("k"), Value: big("1")},
			{Topic: topic, Key: []byte("k"), Value: big("2")},
		}
		errs := p.Publish(ctx(t), recs)
		if errs[0] != nil && errs[1] == nil {
			t.Fatalf("record 1 failed (%v) but the key's later record 2 was acknowledged", errs[0])
		}
		if h.Hits() == 0 {
			t.Fatal("the injected fault was never hit; the test proves nothing")
		}
		want := 0
		for _, err := range errs {
			if err == nil {
				want++
			}
		}
		got := k.ReadAll(t, topic, max(want, 1), 3*time.Second)
		seen1 := false
		for _, r := range got {
			switch r.Value[0] {
			case '1':
				seen1 = true
			case '2':
				if !seen1 {
					t.Fatalf("record 2 reached Kafka before record 1 (errors %v)", errs)
				}
			}
		}
	})

	// The relay calls Publish concurrently (a round and a side retry). A
	// call's records of one key must not be split across requests by
	// another call's records to the same partition: when the first fails
	// the later must not reach Kafka ahead of it (G3).
	t.Run("ConcurrentCallsKeepKeyOrder", func(t *testing.T) {
		t.Parallel()
		k, p := setup(t)
		fake := k.RequireFake(t)
		topic := k.Topic(t, 1)
		requireAllAcked(t, p.Publish(ctx(t), []relay.Record{{Topic: topic, Key: []byte("warm"), Value: []byte("w")}}))
		h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.NotEnoughReplicas, Count: 5})
		val := func(c byte, n int) []byte { return append([]byte{c}, bytes.Repeat([]byte("x"), n)...) }
		other := make(chan []error, 1)
		go func() {
			other <- p.Publish(ctx(t), []relay.Record{{Topic: topic, Key: []byte("j"), Value: val('j', 500<<10)}})
		}()
		errs := p.Publish(ctx(t), []relay.Record{
			{Topic: topic, Key: []byte("k"), Value: val('1', 400<<10)},
			{Topic: topic, Key: []byte("k"), Value: val('2', 200<<10)},
		})
		otherErrs := <-other
		if errs[0] != nil && errs[1] == nil {
			t.Fatalf("record 1 failed (%v) but the key's later record 2 was acknowledged", errs[0])
		}
		if h.Hits() == 0 {
			t.Fatal("the injected fault was never hit; the test proves nothing")
		}
		want := 1 // warm
		for _, err := range append(errs, otherErrs...) {
			if err == nil {
				want++
			}
		}
		seen1 := false
		for _, r := range k.ReadAll(t, topic, want, 3*time.Second) {
			switch r.Value[0] {
			case '1':
				seen1 = true
			case '2':
				if !seen1 {
					t.Fatalf("record 2 reached Kafka before record 1 (errors %v)", errs)
				}
			}
		}
	})

	// A publisher that reports partitions (relay.PartitionReporter, which
	// the relay uses to hold back the keys of a partition that does not
	// acknowledge in time) reports, once it has published to a topic, the
	// partition each keyed record lands in; never one for a keyless record.
	t.Run("ReportsThePartitionOfAKey", func(t *testing.T) {
		t.Parallel()
		k, p := setup(t)
		rep, ok := p.(relay.PartitionReporter)
		if !ok {
			t.Logf("%T does not implement relay.PartitionReporter: the relay learns a sick partition one key at a time", p)
			return
		}
		const partitions = 5
		topic := k.Topic(t, partitions)
		if _, ok := rep.Partition(topic, []byte("k")); ok {
			t.Fatal("a partition was reported for a topic never published to")
		}
		var recs []relay.Record
		for i := range 50 {
			recs = append(recs, relay.Record{Topic: topic, Key: []byte(fmt.Sprint("key-", i)), Value: []byte(fmt.Sprint(i))})
		}
		requireAllAcked(t, p.Publish(ctx(t), recs))
		// The publisher may look the topic up beside the call.
		deadline := time.Now().Add(30 * time.Second)
		for {
			if _, ok := rep.Partition(topic, []byte("key-0")); ok {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("no partition reported 30s after publishing to the topic")
			}
			requireAllAcked(t, p.Publish(ctx(t), recs[:1]))
			time.Sleep(20 * time.Millisecond)
		}
		for _, r := range k.ReadAll(t, topic, len(recs), 30*time.Second) {
			got, ok := rep.Partition(topic, r.Key)
			if !ok || got != r.Partition || got != JavaPartition(r.Key, partitions) {
				t.Fatalf("key %s landed in partition %d (Java's murmur2: %d); reported %d, %v", r.Key, r.Partition, JavaPartition(r.Key, partitions), got, ok)
			}
		}
		if _, ok := rep.Partition(topic, nil); ok {
			t.Fatal("a partition was reported for a keyless record, which the partitioner places as it goes")
		}
	})

	t.Run("CanceledContextReturns", func(t *testing.T) {
		t.Parallel()
		k, p := setup(t)
		fake := k.RequireFake(t)
		topic := k.Topic(t, 1)
		// The broker keeps answering "try again": only ctx can end Publish.
		fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.NotLeaderForPartition, Count: -1})
		c, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		done := make(chan []error, 1)
		go func() { done <- p.Publish(c, []relay.Record{{Topic: topic, Value: []byte("x")}}) }()
		select {
		case errs := <-done:
			if errs[0] == nil || isRefusal(errs[0]) {
				t.Fatalf("after ctx ended: %v, want a passing error", errs[0])
			}
		case <-time.After(30 * time.Second):
			t.Fatal("Publish did not return after ctx ended")
		}
	})
}

func isRefusal(err error) bool {
	return errors.Is(err, relay.ErrRecordTooLarge) || errors.Is(err, relay.ErrTopicForbidden) || errors.Is(err, relay.ErrTopicInvalid) ||
		errors.Is(err, relay.ErrUnknownTopic) || errors.Is(err, relay.ErrRecordInvalid)
}

func requireAllAcked(t *testing.T, errs []error) {
	t.Helper()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("record %d: %v", i, err)
		}
	}
}

// JavaPartition is the partition the Java client picks for a key:
// toPositive(murmur2(key)) % partitions.
func JavaPartition(key []byte, partitions int32) int32 {
	return int32((murmur2(key) & 0x7fffffff) % uint32(partitions))
}

// murmur2 is Kafka's Utils.murmur2.
func murmur2(data []byte) uint32 {
	const (
		seed uint32 = 0x9747b28c
		m    uint32 = 0x5bd1e995
		r           = 24
	)
	length := len(data)
	h := seed ^ uint32(length)
	for i := 0; i+4 <= length; i += 4 {
		k := uint32(data[i]) | uint32(data[i+1])<<8 | uint32(data[i+2])<<16 | uint32(data[i+3])<<24
		k *= m
		k ^= k >> r
		k *= m
		h *= m
		h ^= k
	}
	tail := data[length&^3:]
	switch len(tail) {
	case 3:
		h ^= uint32(tail[2]) << 16
		fallthrough
	case 2:
		h ^= uint32(tail[1]) << 8
		fallthrough
	case 1:
		h ^= uint32(tail[0])
		h *= m
	}
	h ^= h >> 13
	h *= m
	h ^= h >> 15
	return h
}
