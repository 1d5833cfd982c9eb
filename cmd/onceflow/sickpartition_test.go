package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay/relaytest"
)

// TestTheBinaryLearnsASickPartition: the binary wraps its publisher to time
// each Publish (brokerWatch), and the wrapper hid relay.PartitionReporter,
// so relay.New never learned a key's partition: a partition refusing
// writes was never marked sick (onceflow_relay_sick_partitions stayed 0),
// each of its keys waited out the publish timeout on its own, and past
// --max-held-keys the relay stopped every partition rather than the sick
// one. Both publishers report partitions; through the binary they must
// still reach the relay.
func TestTheBinaryLearnsASickPartition(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary; skipped with -short")
	}
	t.Parallel()
	bin := buildBinary(t)
	for _, publisher := range []string{"franz-go", "kafka-go"} {
		t.Run(publisher, func(t *testing.T) {
			t.Parallel()
			schema := pgtest.Schema(t)
			k := kafkatest.New(t)
			fake := k.RequireFake(t)
			topic := k.Topic(t, 4)
			fault := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Partitions: []int32{0}, Err: kerr.NotEnoughReplicas, Count: -1})
			const n = 400
			sick := 0
			msgs := make([]outbox.Message, n)
			for i := range msgs {
				key := []byte(fmt.Sprint("key-", i))
				if relaytest.JavaPartition(key, 4) == 0 {
					sick++
				}
				msgs[i] = outbox.Message{Topic: topic, Key: key, Value: []byte("v")}
			}
			w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
			ctx := context.Background()
			if err := pgx.BeginFunc(ctx, pgtest.Pool(t), func(tx pgx.Tx) error { return w.Write(ctx, tx, msgs...) }); err != nil {
				t.Fatal(err)
			}
			addr := freeAddr(t)
			p := startRelayProc(t, bin, relayEnv(t, schema, k), "--publisher", publisher, "--http-addr", addr,
				"--log-level", "info", "--publish-timeout", "2s", "--batch-size", "50")
			t.Cleanup(func() {
				if t.Failed() {
					t.Logf("relay output:\n%s", tailLines(p.Output(), 30))
				}
			})
			waitUntil(t, "the relay to start", 30*time.Second, relayStarted(p))
			waitUntil(t, "onceflow_relay_sick_partitions to count the refusing partition", 60*time.Second, func() bool {
				_, m := httpGet("http://" + addr + "/metrics")
				return metric(m, "onceflow_relay_sick_partitions") == 1
			})
			waitUntil(t, "every event of the healthy partitions to go out", 60*time.Second, func() bool {
				return count(t, schema, "outbox") == sick
			})
			if fault.Hits() == 0 {
				t.Fatal("the fault was never hit; the test proves nothing")
			}
			_, m := httpGet("http://" + addr + "/metrics")
			if held := metric(m, "onceflow_relay_sick_partition_held_back_total"); held == 0 {
				t.Errorf("onceflow_relay_sick_partition_held_back_total is 0: no new key of the sick partition was held back")
			}
		})
	}
}
