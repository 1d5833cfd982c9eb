// Package kafkatest gives tests a Kafka: kfake in-process by default, a real
// cluster when ONCEFLOW_TEST_KAFKA_BROKERS is set (comma-separated
// host:port), or a Redpanda container when ONCEFLOW_TEST_KAFKA=redpanda and a
// Docker engine is healthy.
package kafkatest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/testcontainers/testcontainers-go/modules/redpanda"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// Kafka is a broker set for one test.
type Kafka struct {
	Brokers []string
	// Fake is the in-process cluster, for fault injection; nil when the
	// tests run against a real cluster.
	Fake *kfake.Cluster
}

// New returns a Kafka for the test. Options apply to kfake only.
func New(t testing.TB, opts ...kfake.Opt) *Kafka {
	t.Helper()
	if brokers := os.Getenv("ONCEFLOW_TEST_KAFKA_BROKERS"); brokers != "" {
		return &Kafka{Brokers: strings.Split(brokers, ",")}
	}
	if os.Getenv("ONCEFLOW_TEST_KAFKA") == "redpanda" && pgtest.DockerHealthy() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		c, err := redpanda.Run(ctx, "docker.redpanda.com/redpandadata/redpanda:v24.2.4")
		if err != nil {
			t.Fatalf("kafkatest: start redpanda: %v", err)
		}
		t.Cleanup(func() { _ = c.Terminate(context.Background()) })
		broker, err := c.KafkaSeedBroker(ctx)
		if err != nil {
			t.Fatalf("kafkatest: redpanda address: %v", err)
		}
		return &Kafka{Brokers: []string{broker}}
	}
	base := []kfake.Opt{kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(100 * time.Millisecond)}
	c, err := kfake.NewCluster(append(base, opts...)...)
	if err != nil {
		t.Fatalf("kafkatest: start kfake: %v", err)
	}
	t.Cleanup(c.Close)
	return &Kafka{Brokers: c.ListenAddrs(), Fake: c}
}

// RequireFake skips tests that inject broker faults when running against a
// real cluster, where faults cannot be injected.
func (k *Kafka) RequireFake(t testing.TB) *kfake.Cluster {
	t.Helper()
	if k.Fake == nil {
		t.Skip("kafkatest: injects broker errors with kfake's fault injection, which a real broker lacks (ONCEFLOW_TEST_KAFKA_BROKERS is set); make test runs it on kfake")
	}
	return k.Fake
}

// Topic creates a uniquely named topic with the given partitions.
func (k *Kafka) Topic(t testing.TB, partitions int32) string {
	t.Helper()
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	name := "t-" + hex.EncodeToString(b)
	k.CreateTopic(t, name, partitions, nil)
	return name
}

// CreateTopic creates a topic with configs (e.g. max.message.bytes).
func (k *Kafka) CreateTopic(t testing.TB, name string, partitions int32, configs map[string]*string) {
	t.Helper()
	adm := k.Admin(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := adm.CreateTopic(ctx, partitions, 1, configs, name)
	if err == nil {
		err = resp.Err
	}
	if err != nil {
		t.Fatalf("kafkatest: create topic %s: %v", name, err)
	}
	if k.Fake == nil {
		WaitTopicReady(t, adm, name, partitions)
	}
}

// WaitTopicReady waits until a real broker serves every partition of a new
// topic: CreateTopics returns once the controller committed the topic, and
// the broker applies it a moment later; until then it answers
// UNKNOWN_TOPIC_OR_PARTITION, which the publishers rightly treat as a
// refusal. kfake applies a topic before it answers.
func WaitTopicReady(t testing.TB, adm *kadm.Client, name string, partitions int32) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	var last error
	for time.Now().Before(deadline) {
		last = topicReady(adm, name, partitions)
		if last == nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("kafkatest: topic %s not served within 60s: %v", name, last)
}

func topicReady(adm *kadm.Client, name string, partitions int32) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	md, err := adm.Metadata(ctx, name)
	if err != nil {
		return err
	}
	d, ok := md.Topics[name]
	switch {
	case !ok:
		return fmt.Errorf("not in metadata")
	case d.Err != nil:
		return d.Err
	case int32(len(d.Partitions)) != partitions:
		return fmt.Errorf("%d of %d partitions in metadata", len(d.Partitions), partitions)
	}
	for _, p := range d.Partitions {
		if p.Err != nil || p.Leader < 0 {
			return fmt.Errorf("partition %d: leader %d, %v", p.Partition, p.Leader, p.Err)
		}
	}
	// ListOffsets is answered by the partition's leader itself: the
	// broker has applied the topic, not only its metadata cache.
	ends, err := adm.ListEndOffsets(ctx, name)
	if err != nil {
		return err
	}
	return ends.Error()
}

// Client returns a franz-go client closed at test end.
func (k *Kafka) Client(t testing.TB, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	base := []kgo.Opt{kgo.SeedBrokers(k.Brokers...), kgo.MetadataMinAge(100 * time.Millisecond)}
	cl, err := kgo.NewClient(append(base, opts...)...)
	if err != nil {
		t.Fatalf("kafkatest: client: %v", err)
	}
	t.Cleanup(cl.Close)
	return cl
}

// Admin returns an admin client closed at test end.
func (k *Kafka) Admin(t testing.TB) *kadm.Client {
	t.Helper()
	return kadm.NewClient(k.Client(t))
}

// ReadAll consumes topic from the start until want records were read or the
// timeout passes, and returns what it read.
func (k *Kafka) ReadAll(t testing.TB, topic string, want int, timeout time.Duration) []*kgo.Record {
	t.Helper()
	cl := k.Client(t, kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var out []*kgo.Record
	for len(out) < want {
		fetches := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			break
		}
		fetches.EachError(func(topic string, p int32, err error) {
			t.Logf("kafkatest: fetch %s/%d: %v", topic, p, err)
		})
		out = append(out, fetches.Records()...)
	}
	return out
}
