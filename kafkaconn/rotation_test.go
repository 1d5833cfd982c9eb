package kafkaconn_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/tlstest"
	"github.com/onceflow/onceflow/kafkaconn"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

// helper 114: the SASL password file and the client certificate and key
// files were read once, at start. When a secret manager rotated them (and
// the broker stopped accepting the old ones), every relay kept
// reconnecting with the old secret until restarted, and none could take
// the others' shards: they all shared it. Each new connection now reads
// the files, so a running client picks the rotated secret up.

// rotatingPublishers returns a kgo and a kafka-go publisher on conn, each
// failing fast so a refused connection is seen within a few seconds.
func rotatingPublishers(t *testing.T, brokers []string, conn kafkaconn.Config) map[string]relay.Publisher {
	t.Helper()
	kp, err := kgopublisher.New(brokers, &kgopublisher.Config{Conn: conn,
		Opts: []kgo.Opt{kgo.RecordRetries(2), kgo.RecordDeliveryTimeout(5 * time.Second)}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { kp.Close() })
	gp, err := kafkagopublisher.New(brokers, &kafkagopublisher.Config{Conn: conn, MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { gp.Close() })
	return map[string]relay.Publisher{"kgo": kp, "kafka-go": gp}
}

// publishesWithin publishes one record at a time until one is
// acknowledged, for up to 30 s, as the relay retries a publish: a client
// dials again with a backoff (kafka-go after its metadata TTL).
func publishesWithin(p relay.Publisher, topic string) (err error) {
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		if err = publishOnce(p, topic); err == nil {
			return nil
		}
	}
	return err
}

// publishOnce publishes one record and returns its error.
func publishOnce(p relay.Publisher, topic string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return p.Publish(ctx, []relay.Record{{Topic: topic, Value: []byte("x")}})[0]
}

func writeFile(t *testing.T, path string, b []byte) {
	t.Helper()
	// As a secret manager does: a new file renamed over the old one.
	tmp := path + ".new"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func TestARotatedSASLPasswordFileIsReadForTheNextConnection(t *testing.T) {
	for _, mech := range []kafkaconn.Mechanism{kafkaconn.Plain, kafkaconn.ScramSHA512} {
		t.Run(string(mech), func(t *testing.T) {
			t.Parallel()
			topic := topicName()
			s, _ := fakeSecured(t, mech, false, topic)
			file := filepath.Join(t.TempDir(), "password")
			writeFile(t, file, []byte("the-old-password\n"))
			conn := s.conn
			conn.SASL = &kafkaconn.SASL{Mechanism: mech, Username: user, PasswordFile: file}
			pubs := rotatingPublishers(t, s.brokers, conn)
			for name, p := range pubs {
				if err := publishOnce(p, topic); err == nil {
					t.Fatalf("%s: published with the old password", name)
				}
			}
			writeFile(t, file, []byte(pass+"\n"))
			for name, p := range pubs {
				if err := publishesWithin(p, topic); err != nil {
					t.Fatalf("%s: 30 s after the password file was rotated: %v", name, err)
				}
			}
		})
	}
}

func TestARotatedClientCertificateIsReadForTheNextConnection(t *testing.T) {
	t.Parallel()
	topic := topicName()
	s, pki := fakeSecured(t, "", true, topic)
	// The certificate first in place is one the brokers do not accept (its
	// CA is not theirs): an expired or revoked one, as far as they care.
	other := tlstest.New(t)
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	copyFile := func(from, to string) {
		b, err := os.ReadFile(from)
		if err != nil {
			t.Fatal(err)
		}
		writeFile(t, to, b)
	}
	copyFile(other.ClientCert, certFile)
	copyFile(other.ClientKey, keyFile)
	conn := s.conn
	conn.TLS = &kafkaconn.TLS{CAFile: pki.CAFile, CertFile: certFile, KeyFile: keyFile}
	pubs := rotatingPublishers(t, s.brokers, conn)
	for name, p := range pubs {
		if err := publishOnce(p, topic); err == nil {
			t.Fatalf("%s: published with a certificate the brokers do not accept", name)
		}
	}
	copyFile(pki.ClientCert, certFile)
	copyFile(pki.ClientKey, keyFile)
	for name, p := range pubs {
		if err := publishesWithin(p, topic); err != nil {
			t.Fatalf("%s: 30 s after the certificate files were rotated: %v", name, err)
		}
	}
}
