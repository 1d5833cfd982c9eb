package kafkaconn_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/goleak"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kafkagoconsumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/kgoconn"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/internal/tlstest"
	"github.com/onceflow/onceflow/kafkaconn"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
		goleak.IgnoreAnyFunction("github.com/jackc/pgx/v5/pgconn/internal/bgreader.(*BGReader).bgRead"),
		goleak.IgnoreAnyFunction("github.com/twmb/franz-go/pkg/kfake.(*Cluster).run"),
		// kafka-go's default transport (used by the readers' group
		// coordination) keeps idle connections by design.
		goleak.IgnoreAnyFunction("github.com/segmentio/kafka-go.(*connPool).discover"),
		goleak.IgnoreAnyFunction("github.com/segmentio/kafka-go/protocol.(*Conn).Read"),
	)
	os.Exit(0)
}

// secured is a broker set that needs conn to be reached.
type secured struct {
	brokers []string
	conn    kafkaconn.Config
	// fake is set on kfake, where topics are seeded at start.
	fake bool
}

const user, pass = "onceflow", "s3cret-pass"

// fakeSecured starts a kfake cluster on TLS (clients must present a
// certificate when mutual) with SASL user onceflow for mech.
func fakeSecured(t *testing.T, mech kafkaconn.Mechanism, mutual bool, topics ...string) (secured, *tlstest.PKI) {
	t.Helper()
	pki := tlstest.New(t)
	opts := []kfake.Opt{kfake.NumBrokers(1), kfake.TLS(pki.ServerConfig(mutual)), kfake.GroupMinSessionTimeout(100 * time.Millisecond)}
	if mech != "" {
		opts = append(opts, kfake.EnableSASL(), kfake.Superuser(string(mech), user, pass))
	}
	if len(topics) > 0 {
		opts = append(opts, kfake.SeedTopics(1, topics...))
	}
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	conn := kafkaconn.Config{ClientID: "onceflow-test", TLS: &kafkaconn.TLS{CAFile: pki.CAFile}}
	if mutual {
		conn.TLS.CertFile, conn.TLS.KeyFile = pki.ClientCert, pki.ClientKey
	}
	if mech != "" {
		conn.SASL = &kafkaconn.SASL{Mechanism: mech, Username: user, Password: pass}
	}
	return secured{brokers: c.ListenAddrs(), conn: conn, fake: true}, pki
}

func topicName() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return "conn-" + hex.EncodeToString(b)
}

// TestEveryClientReachesATLSAndSASLBroker publishes through both
// publishers and consumes through both consumer adapters with one
// kafkaconn.Config, for each SASL mechanism, on kfake's TLS listener with
// mutual TLS.
func TestEveryClientReachesATLSAndSASLBroker(t *testing.T) {
	for _, mech := range []kafkaconn.Mechanism{kafkaconn.Plain, kafkaconn.ScramSHA256, kafkaconn.ScramSHA512} {
		t.Run(string(mech), func(t *testing.T) {
			t.Parallel()
			topic := topicName()
			s, _ := fakeSecured(t, mech, true, topic)
			roundTrip(t, s, topic)
		})
	}
	t.Run("TLSOnly", func(t *testing.T) {
		t.Parallel()
		topic := topicName()
		s, _ := fakeSecured(t, "", false, topic)
		roundTrip(t, s, topic)
	})
}

// roundTrip publishes one record with each publisher and reads both with
// each consumer adapter, all through s.conn.
func roundTrip(t *testing.T, s secured, topic string) {
	t.Helper()
	if !s.fake {
		createTopic(t, s, topic)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	kp, err := kgopublisher.New(s.brokers, &kgopublisher.Config{Conn: s.conn})
	if err != nil {
		t.Fatal(err)
	}
	defer kp.Close()
	publish(ctx, t, kp, topic, "from-kgo")
	gp, err := kafkagopublisher.New(s.brokers, &kafkagopublisher.Config{Conn: s.conn})
	if err != nil {
		t.Fatal(err)
	}
	defer gp.Close()
	publish(ctx, t, gp, topic, "from-kafka-go")

	for _, adapter := range []string{"kgoconsumer", "kafkagoconsumer"} {
		got := consume(t, s, adapter, topic, 2)
		if !got["from-kgo"] || !got["from-kafka-go"] {
			t.Fatalf("%s read %v, want both records", adapter, got)
		}
	}
}

func publish(ctx context.Context, t *testing.T, p relay.Publisher, topic, id string) {
	t.Helper()
	errs := p.Publish(ctx, []relay.Record{{Topic: topic, Key: []byte("k"), Value: []byte(id), Headers: []relay.Header{{Key: "message-id", Value: []byte(id)}}}})
	if errs[0] != nil {
		t.Fatalf("publish %s: %v", id, errs[0])
	}
}

// consume runs a consumer adapter until it processed want messages and
// returns their ids.
func consume(t *testing.T, s secured, adapter, topic string, want int) map[string]bool {
	t.Helper()
	var mu sync.Mutex
	got := map[string]bool{}
	done := make(chan struct{})
	p, err := consumer.New(pgtest.Pool(t), adapter, func(_ context.Context, _ pgx.Tx, m consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		got[m.ID] = true
		if len(got) == want {
			close(done)
		}
		return nil
	}, &consumer.Config{Schema: pgtest.Schema(t)})
	if err != nil {
		t.Fatal(err)
	}
	group := adapter + "-" + topic
	var r interface{ Run(context.Context) error }
	switch adapter {
	case "kgoconsumer":
		r, err = kgoconsumer.New(p, &kgoconsumer.Config{Brokers: s.brokers, Topics: []string{topic}, Group: group, Conn: s.conn,
			ClientOpts: []kgo.Opt{kgo.MetadataMinAge(100 * time.Millisecond), kgo.FetchMaxWait(200 * time.Millisecond)}})
	default:
		r, err = kafkagoconsumer.New(p, &kafkagoconsumer.Config{Conn: s.conn,
			Reader: kafka.ReaderConfig{Brokers: s.brokers, GroupID: group, GroupTopics: []string{topic}, StartOffset: kafka.FirstOffset, MaxWait: 200 * time.Millisecond}})
	}
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- r.Run(ctx) }()
	select {
	case <-done:
	case <-time.After(90 * time.Second):
		t.Errorf("%s: processed %d of %d messages in 90s", adapter, len(got), want)
	}
	cancel()
	if err := <-ran; err != nil {
		t.Errorf("%s Run: %v", adapter, err)
	}
	mu.Lock()
	defer mu.Unlock()
	return got
}

// connClient returns a franz-go client of s's brokers connecting through
// s.conn, closed when the test ends.
func connClient(t *testing.T, s secured) *kgo.Client {
	t.Helper()
	opts, err := kgoconn.Opts(s.conn)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := kgo.NewClient(append(opts, kgo.SeedBrokers(s.brokers...))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

func createTopic(t *testing.T, s secured, topic string) {
	t.Helper()
	cl := connClient(t, s)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	adm := kadm.NewClient(cl)
	resp, err := adm.CreateTopic(ctx, 1, 1, nil, topic)
	if err == nil {
		err = resp.Err
	}
	if err != nil {
		t.Fatalf("create topic %s: %v", topic, err)
	}
	kafkatest.WaitTopicReady(t, adm, topic, 1)
}

// TestWrongCredentialsFailVisibly: a bad password, a missing CA and a
// missing client certificate each fail the publish with an error that says
// so, instead of waiting silently.
func TestWrongCredentialsFailVisibly(t *testing.T) {
	t.Parallel()
	topic := topicName()
	s, _ := fakeSecured(t, kafkaconn.ScramSHA512, true, topic)
	cases := map[string]struct {
		edit func(c *kafkaconn.Config)
		want string
	}{
		// kfake drops the connection (EOF) where Kafka answers
		// SASL_AUTHENTICATION_FAILED: any error will do here.
		"WrongPassword": {func(c *kafkaconn.Config) {
			c.SASL = &kafkaconn.SASL{Mechanism: kafkaconn.ScramSHA512, Username: user, Password: "wrong"}
		}, ""},
		"UnknownCA":    {func(c *kafkaconn.Config) { c.TLS = &kafkaconn.TLS{CertFile: c.TLS.CertFile, KeyFile: c.TLS.KeyFile} }, "certificate"},
		"NoClientCert": {func(c *kafkaconn.Config) { c.TLS = &kafkaconn.TLS{CAFile: c.TLS.CAFile} }, ""},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			conn := s.conn
			tlsCopy := *conn.TLS
			conn.TLS = &tlsCopy
			tc.edit(&conn)
			for _, pub := range []string{"kgo", "kafka-go"} {
				var p relay.Publisher
				var err error
				if pub == "kgo" {
					p, err = kgopublisher.New(s.brokers, &kgopublisher.Config{Conn: conn, Opts: []kgo.Opt{kgo.RecordRetries(2), kgo.RecordDeliveryTimeout(10 * time.Second)}})
				} else {
					p, err = kafkagopublisher.New(s.brokers, &kafkagopublisher.Config{Conn: conn, MaxAttempts: 1})
				}
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				errs := p.Publish(ctx, []relay.Record{{Topic: topic, Value: []byte("x")}})
				cancel()
				p.Close()
				if errs[0] == nil {
					t.Fatalf("%s: publish succeeded with %s", pub, name)
				}
				if !strings.Contains(errs[0].Error(), tc.want) {
					t.Errorf("%s: error %q does not mention %q", pub, errs[0], tc.want)
				}
				t.Logf("%s: %v", pub, errs[0])
			}
		})
	}
}

// realListeners returns the real broker's SSL and SASL_SSL listeners with
// the settings each needs, from the env of scripts/kafka.sh (make
// test-kafka); nil when it is not set.
func realListeners(t *testing.T) map[string]secured {
	t.Helper()
	ssl, sasl := os.Getenv("ONCEFLOW_TEST_KAFKA_SSL_BROKERS"), os.Getenv("ONCEFLOW_TEST_KAFKA_SASL_BROKERS")
	if ssl == "" || sasl == "" {
		return nil
	}
	ca := os.Getenv("ONCEFLOW_TEST_KAFKA_CA_FILE")
	out := map[string]secured{
		"SSL": {brokers: strings.Split(ssl, ","), conn: kafkaconn.Config{TLS: &kafkaconn.TLS{CAFile: ca}}},
		"SSLMutual": {brokers: strings.Split(ssl, ","), conn: kafkaconn.Config{TLS: &kafkaconn.TLS{CAFile: ca,
			CertFile: os.Getenv("ONCEFLOW_TEST_KAFKA_CLIENT_CERT_FILE"), KeyFile: os.Getenv("ONCEFLOW_TEST_KAFKA_CLIENT_KEY_FILE"),
			ServerName: os.Getenv("ONCEFLOW_TEST_KAFKA_SERVER_NAME")}}},
	}
	mechs := os.Getenv("ONCEFLOW_TEST_KAFKA_SASL_MECHANISMS")
	if mechs == "" {
		mechs = "SCRAM-SHA-512,SCRAM-SHA-256,PLAIN"
	}
	for _, m := range strings.Split(mechs, ",") {
		mech, err := kafkaconn.ParseMechanism(m)
		if err != nil {
			t.Fatalf("ONCEFLOW_TEST_KAFKA_SASL_MECHANISMS: %v", err)
		}
		out["SASL_SSL/"+string(mech)] = secured{brokers: strings.Split(sasl, ","), conn: kafkaconn.Config{
			ClientID: "onceflow-test",
			TLS:      &kafkaconn.TLS{CAFile: ca},
			SASL:     &kafkaconn.SASL{Mechanism: mech, Username: os.Getenv("ONCEFLOW_TEST_KAFKA_SASL_USER"), Password: os.Getenv("ONCEFLOW_TEST_KAFKA_SASL_PASSWORD")},
		}}
	}
	return out
}

// TestEveryClientReachesTheRealBroker: the same round trip as on kfake,
// against Apache Kafka's SSL listener (with and without a client
// certificate) and its SASL_SSL listener with each mechanism. Run by make
// test-kafka (scripts/kafka.sh's env).
func TestEveryClientReachesTheRealBroker(t *testing.T) {
	ls := realListeners(t)
	if ls == nil {
		t.Skip("no real broker: ONCEFLOW_TEST_KAFKA_SSL_BROKERS and _SASL_BROKERS are unset (make test-kafka sets them)")
	}
	for name, s := range ls {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			roundTrip(t, s, topicName())
		})
	}
}

// TestRealBrokerRefusesWrongCredentials: a wrong SCRAM password and a
// certificate from another CA fail the publish with an error that says
// what is wrong.
func TestRealBrokerRefusesWrongCredentials(t *testing.T) {
	ls := realListeners(t)
	if ls == nil {
		t.Skip("no real broker: ONCEFLOW_TEST_KAFKA_SSL_BROKERS and _SASL_BROKERS are unset (make test-kafka sets them)")
	}
	good := ls["SASL_SSL/SCRAM-SHA-512"]
	topic := topicName()
	createTopic(t, good, topic)
	other := tlstest.New(t)
	cases := map[string]struct {
		s    secured
		want []string
	}{
		"WrongPassword": {secured{brokers: good.brokers, conn: kafkaconn.Config{TLS: good.conn.TLS,
			SASL: &kafkaconn.SASL{Mechanism: kafkaconn.ScramSHA512, Username: good.conn.SASL.Username, Password: "wrong-password"}}},
			[]string{"SASL", "uthenticat"}},
		"UnknownCA": {secured{brokers: good.brokers, conn: kafkaconn.Config{TLS: &kafkaconn.TLS{CAFile: other.CAFile}, SASL: good.conn.SASL}},
			[]string{"certificate"}},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			for _, pub := range []string{"kgo", "kafka-go"} {
				var p relay.Publisher
				var err error
				if pub == "kgo" {
					p, err = kgopublisher.New(tc.s.brokers, &kgopublisher.Config{Conn: tc.s.conn, Opts: []kgo.Opt{kgo.RecordDeliveryTimeout(15 * time.Second)}})
				} else {
					p, err = kafkagopublisher.New(tc.s.brokers, &kafkagopublisher.Config{Conn: tc.s.conn, MaxAttempts: 1})
				}
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				errs := p.Publish(ctx, []relay.Record{{Topic: topic, Value: []byte("x")}})
				cancel()
				p.Close()
				if errs[0] == nil {
					t.Fatalf("%s: publish succeeded", pub)
				}
				found := false
				for _, w := range tc.want {
					found = found || strings.Contains(errs[0].Error(), w)
				}
				if !found {
					t.Errorf("%s: error %q mentions none of %q", pub, errs[0], tc.want)
				}
				t.Logf("%s: %v", pub, errs[0])
			}
		})
	}
}
