package kafkatest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"os"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

// TestRealBrokerListeners checks the three listeners scripts/kafka.sh starts
// (PLAINTEXT, SSL with an optional client certificate, SASL_SSL with
// SCRAM-SHA-512, SCRAM-SHA-256 and PLAIN) with the addresses, CA and
// credentials of its env file.
func TestRealBrokerListeners(t *testing.T) {
	env := RealEnv(t)
	pem, err := os.ReadFile(env.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		t.Fatalf("no certificate in %s", env.CAFile)
	}
	cert, err := tls.LoadX509KeyPair(env.ClientCertFile, env.ClientKeyFile)
	if err != nil {
		t.Fatal(err)
	}
	serverTLS := &tls.Config{RootCAs: pool, ServerName: env.ServerName}
	mutualTLS := &tls.Config{RootCAs: pool, ServerName: env.ServerName, Certificates: []tls.Certificate{cert}}
	scramAuth := scram.Auth{User: env.SASLUser, Pass: env.SASLPassword}
	for _, c := range []struct {
		name    string
		brokers string
		tls     *tls.Config
		mech    sasl.Mechanism
	}{
		{"PLAINTEXT", env.Brokers, nil, nil},
		{"SSL", env.SSLBrokers, serverTLS, nil},
		{"SSL with client certificate", env.SSLBrokers, mutualTLS, nil},
		{"SASL_SSL SCRAM-SHA-512", env.SASLBrokers, serverTLS, scramAuth.AsSha512Mechanism()},
		{"SASL_SSL SCRAM-SHA-256", env.SASLBrokers, serverTLS, scramAuth.AsSha256Mechanism()},
		{"SASL_SSL PLAIN", env.SASLBrokers, serverTLS, plain.Auth{User: env.SASLUser, Pass: env.SASLPassword}.AsMechanism()},
	} {
		t.Run(c.name, func(t *testing.T) {
			opts := []kgo.Opt{kgo.SeedBrokers(c.brokers)}
			if c.tls != nil {
				opts = append(opts, kgo.DialTLSConfig(c.tls))
			}
			if c.mech != nil {
				opts = append(opts, kgo.SASL(c.mech))
			}
			cl, err := kgo.NewClient(opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer cl.Close()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if _, err := kadm.NewClient(cl).ListBrokers(ctx); err != nil {
				t.Fatalf("%s %s: %v", c.name, c.brokers, err)
			}
		})
	}
	t.Run("SASL_SSL wrong password", func(t *testing.T) {
		cl, err := kgo.NewClient(kgo.SeedBrokers(env.SASLBrokers), kgo.DialTLSConfig(serverTLS),
			kgo.SASL(scram.Auth{User: env.SASLUser, Pass: "wrong"}.AsSha512Mechanism()))
		if err != nil {
			t.Fatal(err)
		}
		defer cl.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := kadm.NewClient(cl).ListBrokers(ctx); err == nil {
			t.Fatal("a wrong SCRAM password was accepted")
		}
	})
}
