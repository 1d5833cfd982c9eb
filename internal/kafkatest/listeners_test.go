package kafkatest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"strconv"
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

// TestRealBrokerPortsAreOutsideTheEphemeralRange: scripts/kafka.sh picks its
// listener ports before the broker binds them. A port inside the kernel's
// ephemeral range can be handed to some outgoing connection in between,
// and the broker then fails to start ("Address already in use": a CI run
// lost TestSickPartitionOnARealBrokerCostsOnlyItsKeys that way).
func TestRealBrokerPortsAreOutsideTheEphemeralRange(t *testing.T) {
	env := RealEnv(t)
	data, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		t.Skipf("no ephemeral port range to check against: %v", err)
	}
	var low, high int
	if _, err := fmt.Sscan(string(data), &low, &high); err != nil {
		t.Fatalf("ip_local_port_range %q: %v", data, err)
	}
	for _, addr := range []string{env.Brokers, env.SSLBrokers, env.SASLBrokers} {
		_, portText, err := net.SplitHostPort(addr)
		if err != nil {
			t.Fatal(err)
		}
		port, err := strconv.Atoi(portText)
		if err != nil {
			t.Fatal(err)
		}
		if port >= low && port <= high {
			t.Errorf("listener %s is inside the ephemeral port range %d-%d", addr, low, high)
		}
	}
}
