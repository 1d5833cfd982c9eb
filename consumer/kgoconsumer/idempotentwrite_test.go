package kgoconsumer_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

type deadLetterFailures chan error

func (d deadLetterFailures) OnDeadLetterFailed(e consumer.DeadLetterFailedEvent) {
	select {
	case d <- e.Err:
	default:
	}
}

// Dead letters are produced idempotently with the group's client. A
// consumer whose principal may read and write topics but not write
// idempotently (MSK with IAM and no kafka-cluster:WriteDataIdempotently)
// is refused a producer id with CLUSTER_AUTHORIZATION_FAILED, and the
// partition waits on its dead letter. franz-go keeps that refusal for the
// client's life, so a grant alone does not mend it: the error must say
// what to grant and that the consumer must then be restarted (a bare
// CLUSTER_AUTHORIZATION_FAILED sends an operator to the topic ACLs).
func TestDeadLetterRefusedIdempotentWriteSaysWhatToDo(t *testing.T) {
	k := kafkatest.New(t)
	fake := k.RequireFake(t)
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	topic := k.Topic(t, 1)
	k.CreateTopic(t, topic+".dlq", 1, nil)

	cl := k.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, &kgo.Record{Topic: topic, Value: []byte("poison"),
		Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte("poison")}}}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	// Installed after the test's own producer has its id.
	fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.InitProducerID}, Err: kerr.ClusterAuthorizationFailed, TopLevel: true, Count: -1})

	failures := make(deadLetterFailures, 1)
	p, err := consumer.New(pool, "ledger", func(context.Context, pgx.Tx, consumer.Message) error {
		return consumer.Permanent(errors.New("cannot handle"))
	}, &consumer.Config{Schema: schema, Hooks: []consumer.Hook{failures}})
	if err != nil {
		t.Fatal(err)
	}
	c, err := kgoconsumer.New(p, &kgoconsumer.Config{
		Brokers: k.Brokers, Topics: []string{topic}, Group: "g",
		ClientOpts: []kgo.Opt{kgo.MetadataMinAge(100 * time.Millisecond), kgo.FetchMaxWait(200 * time.Millisecond)},
	})
	if err != nil {
		t.Fatal(err)
	}
	done := runInBackground(t, c)
	select {
	case err := <-failures:
		for _, want := range []string{"CLUSTER_AUTHORIZATION_FAILED", "IdempotentWrite", "WriteDataIdempotently", "restart"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("the dead letter's error does not name %q: %v", want, err)
			}
		}
	case err := <-done:
		t.Fatalf("Run returned before a dead letter failed: %v", err)
	case <-time.After(45 * time.Second):
		t.Fatal("no dead-letter failure reported within 45s")
	}
}
