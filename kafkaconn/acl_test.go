package kafkaconn_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/tlstest"
	"github.com/onceflow/onceflow/kafkaconn"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

// TestPublishersTellATopicAnACLHidesFromAMissingOne: on a TLS and SASL
// cluster with ACLs, whose brokers create topics on request, a relay
// principal allowed only topics prefixed "ok-" publishes to a granted
// topic, one an ACL hides, and a granted name that does not exist. Both
// publishers report the hidden topic forbidden (the relay waits
// TopicForbiddenGrace) and the missing one unknown, and neither creates
// the missing topic. kafka-go's transport lists only the topics the
// principal may describe, so its publisher asks by name, over the same
// TLS and SASL settings.
func TestPublishersTellATopicAnACLHidesFromAMissingOne(t *testing.T) {
	t.Parallel()
	const admin, relayUser = "admin", "relay"
	pki := tlstest.New(t)
	grant := func(op kmsg.ACLOperation) kfake.ACL {
		return kfake.ACL{Resource: kmsg.ACLResourceTypeTopic, Name: "ok-", Pattern: kmsg.ACLResourcePatternTypePrefixed, Operation: op, Allow: true}
	}
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.TLS(pki.ServerConfig(false)),
		kfake.EnableSASL(), kfake.EnableACLs(), kfake.AllowAutoTopicCreation(),
		kfake.Superuser(string(kafkaconn.ScramSHA512), admin, pass),
		kfake.User(string(kafkaconn.ScramSHA512), relayUser, pass, grant(kmsg.ACLOperationDescribe), grant(kmsg.ACLOperationWrite)),
		kfake.SeedTopics(1, "ok-granted", "hidden"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	conn := kafkaconn.Config{ClientID: "onceflow-test", TLS: &kafkaconn.TLS{CAFile: pki.CAFile},
		SASL: &kafkaconn.SASL{Mechanism: kafkaconn.ScramSHA512, Username: relayUser, Password: pass}}

	kp, err := kgopublisher.New(c.ListenAddrs(), &kgopublisher.Config{Conn: conn, Opts: []kgo.Opt{kgo.RecordDeliveryTimeout(10 * time.Second)}})
	if err != nil {
		t.Fatal(err)
	}
	defer kp.Close()
	gp, err := kafkagopublisher.New(c.ListenAddrs(), &kafkagopublisher.Config{Conn: conn, MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer gp.Close()
	for name, p := range map[string]relay.Publisher{"kgopublisher": kp, "kafkagopublisher": gp} {
		for _, c := range []struct {
			topic string
			want  error
		}{
			{"ok-granted", nil},
			{"hidden", relay.ErrTopicForbidden},
			{"ok-absent", relay.ErrUnknownTopic},
		} {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			err := p.Publish(ctx, []relay.Record{{Topic: c.topic, Key: []byte("k"), Value: []byte("v")}})[0]
			cancel()
			if c.want == nil && err != nil || c.want != nil && !errors.Is(err, c.want) {
				t.Errorf("%s, topic %s: %v, want %v", name, c.topic, err, c.want)
			}
		}
	}

	// The superuser sees every topic: the missing one was not created by
	// anyone's metadata request.
	adminConn := conn
	adminConn.SASL = &kafkaconn.SASL{Mechanism: kafkaconn.ScramSHA512, Username: admin, Password: pass}
	cl := connClient(t, secured{brokers: c.ListenAddrs(), conn: adminConn})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := kmsg.NewPtrMetadataRequest()
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tp := range resp.Topics {
		names = append(names, *tp.Topic)
	}
	if len(names) != 2 {
		t.Fatalf("topics after the publishes: %v, want only ok-granted and hidden (a metadata request auto-created one)", names)
	}
}

// TestKafkaGoPublisherCreatesNoTopicOnTheRealBroker: Apache Kafka creates a
// topic a metadata request asks it to (auto.create.topics.enable is on by
// default, as on scripts/kafka.sh's broker). A publish to a missing topic
// through kafka-go, whose unknown topic is then asked about by name, fails
// as unknown and leaves the topic missing.
func TestKafkaGoPublisherCreatesNoTopicOnTheRealBroker(t *testing.T) {
	ls := realListeners(t)
	if ls == nil {
		t.Skip("no real broker: ONCEFLOW_TEST_KAFKA_SSL_BROKERS and _SASL_BROKERS are unset (make test-kafka sets them)")
	}
	s := ls["SASL_SSL/SCRAM-SHA-512"]
	gp, err := kafkagopublisher.New(s.brokers, &kafkagopublisher.Config{Conn: s.conn, MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer gp.Close()
	topic := topicName()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := gp.Publish(ctx, []relay.Record{{Topic: topic, Key: []byte("k"), Value: []byte("v")}})[0]; !errors.Is(err, relay.ErrUnknownTopic) {
		t.Fatalf("publish to a missing topic: %v, want ErrUnknownTopic", err)
	}
	cl := connClient(t, s)
	topics, err := kadm.NewClient(cl).ListTopics(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if topics.Has(topic) {
		t.Fatalf("publishing to missing topic %s created it", topic)
	}
}
