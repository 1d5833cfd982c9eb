package kafkaconn_test

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"strings"
	"testing"

	"github.com/segmentio/kafka-go/sasl"
	kgosasl "github.com/twmb/franz-go/pkg/sasl"

	"github.com/onceflow/onceflow/internal/kafkagoconn"
	"github.com/onceflow/onceflow/internal/kgoconn"
	"github.com/onceflow/onceflow/internal/tlstest"
	"github.com/onceflow/onceflow/kafkaconn"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

func TestValidateNamesTheField(t *testing.T) {
	pki := tlstest.New(t)
	cases := map[string]struct {
		c    kafkaconn.Config
		want string
	}{
		"NoMechanism":         {kafkaconn.Config{SASL: &kafkaconn.SASL{Username: "u", Password: "pw-9f3a"}}, "SASL.Mechanism: required"},
		"BadMechanism":        {kafkaconn.Config{SASL: &kafkaconn.SASL{Mechanism: "GSSAPI"}}, `SASL.Mechanism: "GSSAPI" is not one of`},
		"NoUser":              {kafkaconn.Config{SASL: &kafkaconn.SASL{Mechanism: kafkaconn.ScramSHA512, Password: "pw-9f3a"}}, "SASL.Username: required for SCRAM-SHA-512"},
		"NoPassword":          {kafkaconn.Config{SASL: &kafkaconn.SASL{Mechanism: kafkaconn.Plain, Username: "u"}}, "SASL.Password: required for PLAIN"},
		"PasswordAndFile":     {kafkaconn.Config{SASL: &kafkaconn.SASL{Mechanism: kafkaconn.Plain, Username: "u", Password: "pw-9f3a", PasswordFile: pki.CAFile}}, "SASL.Password, SASL.PasswordFile: set one"},
		"MissingPasswordFile": {kafkaconn.Config{SASL: &kafkaconn.SASL{Mechanism: kafkaconn.Plain, Username: "u", PasswordFile: "/nonexistent/pw"}}, "SASL.PasswordFile: open /nonexistent/pw"},
		"EmptyPasswordFile":   {kafkaconn.Config{SASL: &kafkaconn.SASL{Mechanism: kafkaconn.Plain, Username: "u", PasswordFile: "/dev/null"}}, "SASL.PasswordFile: /dev/null is empty"},
		"IAMWithPasswordFile": {kafkaconn.Config{SASL: &kafkaconn.SASL{Mechanism: kafkaconn.AWSMSKIAM, PasswordFile: "/dev/null"}}, "unused by AWS_MSK_IAM"},
		"IAMWithPassword":     {kafkaconn.Config{SASL: &kafkaconn.SASL{Mechanism: kafkaconn.AWSMSKIAM, Password: "pw-9f3a"}}, "unused by AWS_MSK_IAM"},
		"MissingCA":           {kafkaconn.Config{TLS: &kafkaconn.TLS{CAFile: "/nonexistent/ca.pem"}}, "TLS.CAFile: open /nonexistent/ca.pem"},
		"CAIsNotPEM":          {kafkaconn.Config{TLS: &kafkaconn.TLS{CAFile: pki.ClientKey}}, "TLS.CAFile:"},
		"CertWithoutKey":      {kafkaconn.Config{TLS: &kafkaconn.TLS{CertFile: pki.ClientCert}}, "TLS.KeyFile: required with TLS.CertFile"},
		"KeyWithoutCert":      {kafkaconn.Config{TLS: &kafkaconn.TLS{KeyFile: pki.ClientKey}}, "TLS.CertFile: required with TLS.KeyFile"},
		"CertKeyMismatch":     {kafkaconn.Config{TLS: &kafkaconn.TLS{CertFile: pki.ClientCert, KeyFile: pki.ServerKey}}, "TLS.CertFile, TLS.KeyFile:"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			err := tc.c.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate() = %v, want an error containing %q", err, tc.want)
			}
			if tc.c.SASL != nil && tc.c.SASL.Password != "" && strings.Contains(err.Error(), tc.c.SASL.Password) {
				t.Fatalf("error %q shows the password", err)
			}
			// Every adapter reports the same error under its Config.Conn.
			_, err = kgopublisher.New([]string{"127.0.0.1:1"}, &kgopublisher.Config{Conn: tc.c})
			if err == nil || !strings.Contains(err.Error(), "kgopublisher: Config.Conn.SASL") && !strings.Contains(err.Error(), "kgopublisher: Config.Conn.TLS") || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("kgopublisher.New = %v", err)
			}
			_, err = kafkagopublisher.New([]string{"127.0.0.1:1"}, &kafkagopublisher.Config{Conn: tc.c})
			if err == nil || !strings.Contains(err.Error(), "kafkagopublisher: Config.Conn.SASL") && !strings.Contains(err.Error(), "kafkagopublisher: Config.Conn.TLS") || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("kafkagopublisher.New = %v", err)
			}
		})
	}
	ok := kafkaconn.Config{TLS: &kafkaconn.TLS{CAFile: pki.CAFile, CertFile: pki.ClientCert, KeyFile: pki.ClientKey, ServerName: "kafka"},
		SASL: &kafkaconn.SASL{Mechanism: kafkaconn.ScramSHA256, Username: "u", Password: "hunter2"}}
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
	if s := ok.String(); strings.Contains(s, "hunter2") || !strings.Contains(s, "SCRAM-SHA-256") {
		t.Fatalf("String() = %q", s)
	}
	tc, err := ok.TLSConfig()
	if err != nil || tc.ServerName != "kafka" || tc.InsecureSkipVerify || tc.GetClientCertificate == nil || tc.RootCAs == nil {
		t.Fatalf("TLSConfig() = %+v, %v", tc, err)
	}
	// The client certificate is read at each handshake (rotation_test.go).
	if cert, err := tc.GetClientCertificate(&tls.CertificateRequestInfo{}); err != nil || len(cert.Certificate) == 0 {
		t.Fatalf("GetClientCertificate() = %v, %v", cert, err)
	}
}

func TestParseMechanismAnyCase(t *testing.T) {
	for in, want := range map[string]kafkaconn.Mechanism{"plain": kafkaconn.Plain, "scram-sha-512": kafkaconn.ScramSHA512, "SCRAM-SHA-256": kafkaconn.ScramSHA256, "aws_msk_iam": kafkaconn.AWSMSKIAM} {
		if got, err := kafkaconn.ParseMechanism(in); err != nil || got != want {
			t.Errorf("ParseMechanism(%q) = %q, %v", in, got, err)
		}
	}
	if _, err := kafkaconn.ParseMechanism("OAUTHBEARER"); err == nil {
		t.Error("ParseMechanism(OAUTHBEARER) succeeded")
	}
}

func TestParseBrokers(t *testing.T) {
	hosts, proto, err := kafkaconn.ParseBrokers([]string{"SASL_SSL://b-1.example:9096", "sasl_ssl://b-2.example:9096/"})
	if err != nil || proto != kafkaconn.SASLSSL || strings.Join(hosts, ",") != "b-1.example:9096,b-2.example:9096" || !proto.TLS() || !proto.SASL() {
		t.Fatalf("ParseBrokers = %v %q %v", hosts, proto, err)
	}
	hosts, proto, err = kafkaconn.ParseBrokers([]string{"a:9092", "[::1]:9092"})
	if err != nil || proto != "" || len(hosts) != 2 {
		t.Fatalf("ParseBrokers plain = %v %q %v", hosts, proto, err)
	}
	for _, bad := range [][]string{{"HTTP://a:1"}, {"SSL://a:1", "a:2"}, {"SSL://a:1", "SASL_SSL://b:2"}, {"a"}, {"SSL://a"}, {":9092"}, {"SASL_SSL://:9096"}} {
		if _, _, err := kafkaconn.ParseBrokers(bad); err == nil {
			t.Errorf("ParseBrokers(%q) accepted", bad)
		}
	}
	// Credentials written into an address (as in some URLs) are refused
	// without being repeated in the error, which the relay prints.
	if _, _, err := kafkaconn.ParseBrokers([]string{"SASL_SSL://user:hunter2@b-1:9096"}); err == nil || strings.Contains(err.Error(), "hunter2") {
		t.Errorf("ParseBrokers with user:password@ = %v, want an error without the password", err)
	}
	// Adapters refuse a prefixed address rather than resolving it as a
	// host name and retrying silently forever.
	_, err = kgopublisher.New([]string{"SASL_SSL://b:9096"}, nil)
	if err == nil || !strings.Contains(err.Error(), "listener prefix") {
		t.Errorf("kgopublisher.New(SASL_SSL://) = %v", err)
	}
	_, err = kafkagopublisher.New([]string{"SASL_SSL://b:9096"}, nil)
	if err == nil || !strings.Contains(err.Error(), "listener prefix") {
		t.Errorf("kafkagopublisher.New(SASL_SSL://) = %v", err)
	}
}

// TestAWSMSKIAMBuildsSignedMechanism checks AWS_MSK_IAM at the
// configuration level (no MSK here): both clients get a mechanism named
// AWS_MSK_IAM whose first message is a SigV4 presigned kafka-cluster:Connect
// for the broker's region with the configured credentials.
func TestAWSMSKIAMBuildsSignedMechanism(t *testing.T) {
	t.Setenv("AWS_REGION", "")
	t.Setenv("AWS_DEFAULT_REGION", "")
	s := &kafkaconn.SASL{Mechanism: kafkaconn.AWSMSKIAM, AWSCredentials: func(context.Context) (kafkaconn.AWSCredentials, error) {
		return kafkaconn.AWSCredentials{AccessKeyID: "AKIDEXAMPLE", SecretAccessKey: "secret", SessionToken: "tok"}, nil
	}}
	if err := (kafkaconn.Config{TLS: &kafkaconn.TLS{}, SASL: s}).Validate(); err != nil {
		t.Fatal(err)
	}
	const host = "b-1.demo.abc123.c2.kafka.eu-west-1.amazonaws.com:9098"
	check := func(client string, first []byte) {
		t.Helper()
		var m map[string]string
		if err := json.Unmarshal(first, &m); err != nil {
			t.Fatalf("%s: first message %q: %v", client, first, err)
		}
		if m["action"] != "kafka-cluster:Connect" || !strings.HasPrefix(m["x-amz-credential"], "AKIDEXAMPLE/") ||
			!strings.Contains(m["x-amz-credential"], "/eu-west-1/kafka-cluster/aws4_request") || m["x-amz-security-token"] != "tok" || m["x-amz-signature"] == "" {
			t.Fatalf("%s: first message %v", client, m)
		}
	}

	km, err := kgoconn.Mechanism(s)
	if err != nil || km.Name() != "AWS_MSK_IAM" {
		t.Fatalf("franz-go mechanism %v, %v", km, err)
	}
	_, first, err := km.Authenticate(context.Background(), host)
	if err != nil {
		t.Fatal(err)
	}
	check("franz-go", first)
	var _ kgosasl.Mechanism = km

	gm, err := kafkagoconn.Mechanism(s)
	if err != nil || gm.Name() != "AWS_MSK_IAM" {
		t.Fatalf("kafka-go mechanism %v, %v", gm, err)
	}
	ctx := sasl.WithMetadata(context.Background(), &sasl.Metadata{Host: "b-1.demo.abc123.c2.kafka.eu-west-1.amazonaws.com", Port: 9098})
	_, first, err = gm.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	check("kafka-go", first)

	// A host without a region and none configured is an error naming the fix.
	if _, _, err := gm.Start(sasl.WithMetadata(context.Background(), &sasl.Metadata{Host: "kafka.internal", Port: 9098})); err == nil || !strings.Contains(err.Error(), "AWSRegion") {
		t.Fatalf("no region: %v", err)
	}
	s.AWSRegion = "us-east-2"
	if _, first, err = gm.Start(sasl.WithMetadata(context.Background(), &sasl.Metadata{Host: "kafka.internal", Port: 9098})); err != nil || !strings.Contains(string(first), "/us-east-2/") {
		t.Fatalf("configured region: %s, %v", first, err)
	}

	// Without AWSCredentials the environment's keys are used.
	t.Setenv("AWS_ACCESS_KEY_ID", "AKIDENV")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "secretenv")
	s.AWSCredentials = nil
	gm, _ = kafkagoconn.Mechanism(s)
	if _, first, err = gm.Start(ctx); err != nil || !strings.Contains(string(first), "AKIDENV/") {
		t.Fatalf("env credentials: %s, %v", first, err)
	}
}

// A broker port that is not a number from 1 to 65535 is refused, naming
// the address, by ParseBrokers (the binary's --brokers) and CheckBrokers
// (the adapters' New): the clients would retry it forever, as if the
// brokers were down (a cold review found "localhost:99999" accepted). A
// host without a port stays the client's to default.
func TestBrokerPortsAreNumbers(t *testing.T) {
	for _, a := range []string{"localhost:abc", "localhost:99999", "localhost:-1", "localhost: 9092", "localhost:0"} {
		if _, _, err := kafkaconn.ParseBrokers([]string{a}); err == nil || !strings.Contains(err.Error(), a) {
			t.Errorf("ParseBrokers(%q): %v, want an error naming it", a, err)
		}
		if err := kafkaconn.CheckBrokers([]string{a}); err == nil || !strings.Contains(err.Error(), a) {
			t.Errorf("CheckBrokers(%q): %v, want an error naming it", a, err)
		}
	}
	for _, a := range []string{"localhost:9092", "[::1]:65535", "b-1.example.com:9096"} {
		if _, _, err := kafkaconn.ParseBrokers([]string{a}); err != nil {
			t.Errorf("ParseBrokers(%q): %v", a, err)
		}
		if err := kafkaconn.CheckBrokers([]string{a}); err != nil {
			t.Errorf("CheckBrokers(%q): %v", a, err)
		}
	}
	// A host without a port, or a port without a host (the local host),
	// stays the client's to read, as before ports were checked.
	for _, a := range []string{"localhost", ":9092"} {
		if err := kafkaconn.CheckBrokers([]string{a}); err != nil {
			t.Errorf("CheckBrokers(%q): %v, want it left to the client", a, err)
		}
	}
}
