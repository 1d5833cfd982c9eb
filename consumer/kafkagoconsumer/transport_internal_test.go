package kafkagoconsumer

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/tlstest"
)

// fixedResolver answers every name with one address, as a service
// discovery hook would.
type fixedResolver struct{ host string }

func (r fixedResolver) LookupHost(context.Context, string) ([]string, error) {
	return []string{r.host}, nil
}

// TestFetchesDialLikeTheReadersDialer: Config.Reader.Dialer reached the
// group coordinator, but fetches, offset lookups and the dead-letter
// writer (kafka.Transport) took only its TLS, SASL and client id: a
// Resolver (service discovery), a DialFunc (a proxy, a tunnel), LocalAddr
// or KeepAlive did not apply there, so a broker named through the resolver
// was "no such host" for every fetch.
func TestFetchesDialLikeTheReadersDialer(t *testing.T) {
	k := kafkatest.New(t)
	topic := k.Topic(t, 1)
	_, port, err := net.SplitHostPort(k.Brokers[0])
	if err != nil {
		t.Fatal(err)
	}
	made := "kafka.internal.invalid:" + port
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	var dials atomic.Int32
	for name, d := range map[string]*kafka.Dialer{
		"resolver": {Resolver: fixedResolver{"127.0.0.1"}, Timeout: 5 * time.Second},
		"dial func": {DialFunc: func(ctx context.Context, network, address string) (net.Conn, error) {
			dials.Add(1)
			if strings.HasPrefix(address, "kafka.internal.invalid:") {
				address = "127.0.0.1:" + port
			}
			return (&net.Dialer{}).DialContext(ctx, network, address)
		}},
	} {
		tr := newTransport(d)
		client := &kafka.Client{Addr: kafka.TCP(made), Transport: tr}
		res, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
		if err != nil {
			t.Errorf("%s: metadata through the Reader's dialer settings: %v", name, err)
			continue
		}
		if len(res.Topics) != 1 || res.Topics[0].Name != topic {
			t.Errorf("%s: metadata %+v, want topic %s", name, res.Topics, topic)
		}
		tr.CloseIdleConnections()
	}
	if dials.Load() == 0 {
		t.Error("the Dialer's DialFunc was never called")
	}
}

// TestFetchesOverTLSVerifyTheNameTheDialerVerifies: with a Resolver, the
// Reader's Dialer takes the TLS server name from the resolved host; fetches
// took it from the name before resolution, so a broker whose certificate
// names the resolved host (here "localhost", the made-up name resolving to
// it) passed for the group and failed every fetch with an x509 error.
func TestFetchesOverTLSVerifyTheNameTheDialerVerifies(t *testing.T) {
	pki := tlstest.New(t)
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.TLS(pki.ServerConfig(false)), kfake.SeedTopics(1, "tls-topic"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, port, _ := net.SplitHostPort(c.ListenAddrs()[0])
	ca, err := os.ReadFile(pki.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca)
	d := &kafka.Dialer{Resolver: fixedResolver{"localhost"}, TLS: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}, Timeout: 5 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// The group's path verifies "localhost".
	conn, err := d.DialContext(ctx, "tcp", "kafka.internal.invalid:"+port)
	if err != nil {
		t.Fatalf("the Reader's Dialer: %v", err)
	}
	conn.Close()
	tr := newTransport(d)
	defer tr.CloseIdleConnections()
	client := &kafka.Client{Addr: kafka.TCP("kafka.internal.invalid:" + port), Transport: tr}
	res, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{"tls-topic"}})
	if err != nil {
		t.Fatalf("fetches' transport over TLS through the resolver: %v", err)
	}
	if len(res.Topics) != 1 || res.Topics[0].Name != "tls-topic" {
		t.Fatalf("metadata %+v", res.Topics)
	}
}
