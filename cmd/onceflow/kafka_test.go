package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/kgoconn"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/internal/tlstest"
	"github.com/onceflow/onceflow/kafkaconn"
	"github.com/onceflow/onceflow/outbox"
)

func randomTopic() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return "t-" + hex.EncodeToString(b)
}

// readSecured reads want records of topic through conn.
func readSecured(t *testing.T, brokers []string, conn kafkaconn.Config, topic string, want int) []*kgo.Record {
	t.Helper()
	opts, err := kgoconn.Opts(conn)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := kgo.NewClient(append(opts, kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))...)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out []*kgo.Record
	for len(out) < want && ctx.Err() == nil {
		out = append(out, cl.PollFetches(ctx).Records()...)
	}
	return out
}

// TestRelayPublishesToASASLSSLCluster runs the relay binary against a
// SASL_SSL listener (kfake: TLS with a private CA, SCRAM-SHA-512) with the
// --kafka-* flags, the password from the environment or a file, and both
// publishers; the events arrive, and the password is never printed.
func TestRelayPublishesToASASLSSLCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary; skipped with -short")
	}
	bin := buildBinary(t)
	const password = "pa55-w0rd-never-logged"
	for _, publisher := range []string{"franz-go", "kafka-go"} {
		t.Run(publisher, func(t *testing.T) {
			t.Parallel()
			pki := tlstest.New(t)
			topic := randomTopic()
			c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.TLS(pki.ServerConfig(false)), kfake.EnableSASL(),
				kfake.Superuser("SCRAM-SHA-512", "relay", password), kfake.SeedTopics(2, topic))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(c.Close)
			var brokers []string
			for _, a := range c.ListenAddrs() {
				brokers = append(brokers, "SASL_SSL://"+a)
			}
			schema := pgtest.Schema(t)
			env := []string{
				"ONCEFLOW_DATABASE_URL=" + pgtest.URL(t),
				"ONCEFLOW_SCHEMA=" + schema,
				"ONCEFLOW_BROKERS=" + strings.Join(brokers, ","),
				"ONCEFLOW_KAFKA_TLS_CA_FILE=" + pki.CAFile,
				"ONCEFLOW_KAFKA_SASL_MECHANISM=scram-sha-512",
			}
			args := []string{"--publisher", publisher, "--log-level", "debug", "--kafka-sasl-username", "relay"}
			if publisher == "kafka-go" {
				file := filepath.Join(t.TempDir(), "password")
				if err := os.WriteFile(file, []byte(password+"\n"), 0o600); err != nil {
					t.Fatal(err)
				}
				args = append(args, "--kafka-sasl-password-file", file)
			} else {
				env = append(env, "ONCEFLOW_KAFKA_SASL_PASSWORD="+password)
			}
			p := startRelayProc(t, bin, env, args...)
			waitUntil(t, "the relay to start", 30*time.Second, relayStarted(p))
			w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
			var msgs []outbox.Message
			for i := range 20 {
				msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint(i % 3)), Value: []byte("v")})
			}
			ctx := context.Background()
			if err := pgx.BeginFunc(ctx, pgtest.Pool(t), func(tx pgx.Tx) error { return w.Write(ctx, tx, msgs...) }); err != nil {
				t.Fatal(err)
			}
			waitUntil(t, "the outbox to drain", 60*time.Second, func() bool { return count(t, schema, "outbox") == 0 })
			conn := kafkaconn.Config{TLS: &kafkaconn.TLS{CAFile: pki.CAFile}, SASL: &kafkaconn.SASL{Mechanism: kafkaconn.ScramSHA512, Username: "relay", Password: password}}
			if got := readSecured(t, c.ListenAddrs(), conn, topic, 20); len(got) < 20 {
				t.Fatalf("read %d records, want 20", len(got))
			}
			_ = p.Signal(syscall.SIGTERM)
			if err, exited := p.Wait(30 * time.Second); !exited || err != nil {
				t.Fatalf("after SIGTERM: exited %v, err %v", exited, err)
			}
			out := p.Output()
			if strings.Contains(out, password) {
				t.Fatalf("the relay printed the password:\n%s", out)
			}
			if !strings.Contains(out, "sasl=SCRAM-SHA-512") || !strings.Contains(out, "user=relay") {
				t.Errorf("start line does not say how it connects:\n%s", out)
			}
		})
	}
}

// TestKafkaFlagsRefuseWhatTheyCannotHonour: a listener prefix is understood
// or refused, never accepted and ignored; a SASL setting without its
// mechanism, a missing password, or a TLS file that does not exist are
// usage errors naming the flag.
func TestKafkaFlagsRefuseWhatTheyCannotHonour(t *testing.T) {
	for _, v := range []string{"ONCEFLOW_BROKERS", "ONCEFLOW_KAFKA_SASL_PASSWORD", "ONCEFLOW_KAFKA_SASL_MECHANISM", "ONCEFLOW_KAFKA_TLS"} {
		t.Setenv(v, "")
		os.Unsetenv(v)
	}
	url := pgtest.URL(t)
	relay := func(args ...string) []string {
		return append([]string{"relay", "--database-url", url}, args...)
	}
	cases := map[string]struct {
		args []string
		want string
	}{
		"sasl prefix, no mechanism": {relay("--brokers", "SASL_SSL://b:9096"), "--kafka-sasl-mechanism: required by SASL_SSL:// brokers"},
		"unknown prefix":            {relay("--brokers", "HTTPS://b:9096"), `unknown listener prefix "HTTPS"`},
		"mixed prefixes":            {relay("--brokers", "SSL://a:1,b:2"), "same listener prefix"},
		"tls on plaintext listener": {relay("--brokers", "PLAINTEXT://a:1", "--kafka-tls"), "are not TLS"},
		"sasl on ssl listener":      {relay("--brokers", "SSL://a:1", "--kafka-sasl-mechanism", "PLAIN", "--kafka-sasl-username", "u"), "have no SASL"},
		"bad mechanism":             {relay("--brokers", "a:1", "--kafka-sasl-mechanism", "GSSAPI"), `--kafka-sasl-mechanism: "GSSAPI" is not one of`},
		"no password":               {relay("--brokers", "a:1", "--kafka-sasl-mechanism", "SCRAM-SHA-512", "--kafka-sasl-username", "u"), "ONCEFLOW_KAFKA_SASL_PASSWORD (or --kafka-sasl-password-file): required"},
		"empty password file":       {relay("--brokers", "a:1", "--kafka-sasl-mechanism", "PLAIN", "--kafka-sasl-username", "u", "--kafka-sasl-password-file", "/dev/null"), "--kafka-sasl-password-file: /dev/null is empty"},
		"no user":                   {relay("--brokers", "a:1", "--kafka-sasl-mechanism", "PLAIN", "--kafka-sasl-password-file", "/dev/null"), "--kafka-sasl-username: required for PLAIN"},
		"user without mechanism":    {relay("--brokers", "a:1", "--kafka-sasl-username", "u"), "--kafka-sasl-mechanism: required when"},
		"missing ca file":           {relay("--brokers", "a:1", "--kafka-tls-ca-file", "/nonexistent.pem"), "--kafka-tls-ca-file: open /nonexistent.pem"},
		"cert without key":          {relay("--brokers", "a:1", "--kafka-tls-cert-file", "/etc/hostname"), "--kafka-tls-key-file: required"},
		"password file missing":     {relay("--brokers", "a:1", "--kafka-sasl-mechanism", "PLAIN", "--kafka-sasl-username", "u", "--kafka-sasl-password-file", "/nonexistent"), "--kafka-sasl-password-file: open"},
		"no password flag":          {relay("--brokers", "a:1", "--kafka-sasl-password", "x"), "flag provided but not defined: -kafka-sasl-password"},
		"bad compression":           {relay("--brokers", "a:1", "--compression", "brotli"), `--compression: "brotli"`},
		"tiny max record bytes":     {relay("--brokers", "a:1", "--max-record-bytes", "10"), "--max-record-bytes: 10"},
	}
	for name, tc := range cases {
		out, err := runCLI(t, tc.args...)
		if !errors.Is(err, errUsage) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want a usage error containing %q\n%s", name, err, tc.want, out)
		}
	}
	t.Setenv("ONCEFLOW_KAFKA_SASL_PASSWORD", "from-env")
	if _, err := runCLI(t, relay("--brokers", "a:1", "--kafka-sasl-mechanism", "PLAIN", "--kafka-sasl-username", "u", "--kafka-sasl-password-file", "/dev/null")...); err == nil || !strings.Contains(err.Error(), "give one") {
		t.Errorf("password in env and file: %v", err)
	}
}

// TestOversizedEventPublishedAfterRaisingTheLimit follows README's remedy
// for a dead-lettered oversized event: a relay with a client-side record
// limit below the event dead-letters it; a relay with the limit raised and
// `onceflow dead replay --all` publish it, with its original message-id.
func TestOversizedEventPublishedAfterRaisingTheLimit(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary; skipped with -short")
	}
	bin := buildBinary(t)
	for _, publisher := range []string{"franz-go", "kafka-go"} {
		t.Run(publisher, func(t *testing.T) {
			t.Parallel()
			schema := pgtest.Schema(t)
			k := kafkatest.New(t)
			topic := k.Topic(t, 1)
			env := relayEnv(t, schema, k)
			p := startRelayProc(t, bin, env, "--publisher", publisher, "--max-record-bytes", "4096", "--log-level", "info")
			waitUntil(t, "the relay to start", 30*time.Second, relayStarted(p))
			w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
			big := make([]byte, 20_000)
			ctx := context.Background()
			if err := pgx.BeginFunc(ctx, pgtest.Pool(t), func(tx pgx.Tx) error {
				return w.Write(ctx, tx, outbox.Message{Topic: topic, Key: []byte("k"), Value: big})
			}); err != nil {
				t.Fatal(err)
			}
			waitUntil(t, "the event to be dead-lettered", 60*time.Second, func() bool { return count(t, schema, "outbox_dead") == 1 })
			var eventID, reason string
			if err := pgtest.Pool(t).QueryRow(ctx, `SELECT event_id::text, error FROM `+pgx.Identifier{schema, "outbox_dead"}.Sanitize()).Scan(&eventID, &reason); err != nil {
				t.Fatal(err)
			}
			t.Logf("dead-lettered: %s", reason)
			_ = p.Signal(syscall.SIGTERM)
			if err, exited := p.Wait(30 * time.Second); !exited || err != nil {
				t.Fatalf("after SIGTERM: exited %v, err %v", exited, err)
			}

			p = startRelayProc(t, bin, env, "--publisher", publisher, "--max-record-bytes", "1000012", "--log-level", "info")
			waitUntil(t, "the relay to start", 30*time.Second, relayStarted(p))
			if out, err := runCLI(t, "dead", "replay", "--all", "--database-url", pgtest.URL(t), "--schema", schema); err != nil || !strings.Contains(out, "replayed 1") {
				t.Fatalf("dead replay: %v\n%s", err, out)
			}
			waitUntil(t, "the replayed event to be published", 60*time.Second, func() bool {
				return count(t, schema, "outbox") == 0 && count(t, schema, "outbox_dead") == 0
			})
			recs := k.ReadAll(t, topic, 1, 30*time.Second)
			if len(recs) != 1 || len(recs[0].Value) != len(big) {
				t.Fatalf("read %d records, want the 20000-byte event", len(recs))
			}
			for _, h := range recs[0].Headers {
				if h.Key == "message-id" && string(h.Value) != eventID {
					t.Fatalf("message-id %s, want the dead-lettered event's %s", h.Value, eventID)
				}
			}
		})
	}
}

// TestRelayPublishesToTheRealSASLSSLListener: the relay binary, configured
// as README's production example (SASL_SSL:// brokers, a CA file,
// SCRAM-SHA-512, the password from a file), publishes to Apache Kafka's
// SASL_SSL listener with each publisher. Run by make test-kafka.
func TestRelayPublishesToTheRealSASLSSLListener(t *testing.T) {
	sasl := os.Getenv("ONCEFLOW_TEST_KAFKA_SASL_BROKERS")
	if sasl == "" {
		t.Skip("no real broker: ONCEFLOW_TEST_KAFKA_SASL_BROKERS is unset (make test-kafka sets it)")
	}
	bin := buildBinary(t)
	user, password, ca := os.Getenv("ONCEFLOW_TEST_KAFKA_SASL_USER"), os.Getenv("ONCEFLOW_TEST_KAFKA_SASL_PASSWORD"), os.Getenv("ONCEFLOW_TEST_KAFKA_CA_FILE")
	brokers := strings.Split(sasl, ",")
	conn := kafkaconn.Config{TLS: &kafkaconn.TLS{CAFile: ca}, SASL: &kafkaconn.SASL{Mechanism: kafkaconn.ScramSHA512, Username: user, Password: password}}
	file := filepath.Join(t.TempDir(), "password")
	if err := os.WriteFile(file, []byte(password+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, publisher := range []string{"franz-go", "kafka-go"} {
		t.Run(publisher, func(t *testing.T) {
			t.Parallel()
			topic := randomTopic()
			opts, err := kgoconn.Opts(conn)
			if err != nil {
				t.Fatal(err)
			}
			cl, err := kgo.NewClient(append(opts, kgo.SeedBrokers(brokers...))...)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			adm := kadm.NewClient(cl)
			resp, err := adm.CreateTopic(ctx, 2, 1, nil, topic)
			cancel()
			if err == nil {
				err = resp.Err
			}
			if err != nil {
				t.Fatalf("create topic: %v", err)
			}
			kafkatest.WaitTopicReady(t, adm, topic, 2)
			cl.Close()
			var prefixed []string
			for _, b := range brokers {
				prefixed = append(prefixed, "SASL_SSL://"+b)
			}
			schema := pgtest.Schema(t)
			env := []string{"ONCEFLOW_DATABASE_URL=" + pgtest.URL(t), "ONCEFLOW_SCHEMA=" + schema}
			p := startRelayProc(t, bin, env, "--publisher", publisher, "--log-level", "info",
				"--brokers", strings.Join(prefixed, ","), "--kafka-tls-ca-file", ca,
				"--kafka-sasl-mechanism", "SCRAM-SHA-512", "--kafka-sasl-username", user, "--kafka-sasl-password-file", file)
			waitUntil(t, "the relay to start", 60*time.Second, relayStarted(p))
			w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
			var msgs []outbox.Message
			for i := range 20 {
				msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint(i % 3)), Value: []byte("v")})
			}
			bg := context.Background()
			if err := pgx.BeginFunc(bg, pgtest.Pool(t), func(tx pgx.Tx) error { return w.Write(bg, tx, msgs...) }); err != nil {
				t.Fatal(err)
			}
			waitUntil(t, "the outbox to drain", 90*time.Second, func() bool { return count(t, schema, "outbox") == 0 })
			if got := readSecured(t, brokers, conn, topic, 20); len(got) < 20 {
				t.Fatalf("read %d records, want 20", len(got))
			}
			_ = p.Signal(syscall.SIGTERM)
			if err, exited := p.Wait(30 * time.Second); !exited || err != nil {
				t.Fatalf("after SIGTERM: exited %v, err %v", exited, err)
			}
			if strings.Contains(p.Output(), password) {
				t.Fatal("the relay printed the password")
			}
		})
	}
}
