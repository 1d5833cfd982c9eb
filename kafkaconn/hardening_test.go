package kafkaconn_test

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/kafkaconn"
)

// TestInsecureSkipVerifyIsNotSilent: skipping verification drops whatever a
// CA file asked to verify, so asking for both is refused rather than
// silently weakened (a server name still sets SNI: allowed), and the
// Config's description (the relay's start line) says verification is off.
func TestInsecureSkipVerifyIsNotSilent(t *testing.T) {
	err := kafkaconn.Config{TLS: &kafkaconn.TLS{InsecureSkipVerify: true, CAFile: "/etc/ssl/certs/ca-certificates.crt"}}.Validate()
	if err == nil || !strings.Contains(err.Error(), "TLS.InsecureSkipVerify") {
		t.Errorf("a CA file with InsecureSkipVerify: err = %v, want it refused naming TLS.InsecureSkipVerify", err)
	}
	if err := (kafkaconn.Config{TLS: &kafkaconn.TLS{InsecureSkipVerify: true, ServerName: "broker.sni.example"}}).Validate(); err != nil {
		t.Errorf("a server name (SNI) with InsecureSkipVerify: %v, want it allowed", err)
	}
	if s := (kafkaconn.Config{TLS: &kafkaconn.TLS{InsecureSkipVerify: true}}).String(); !strings.Contains(s, "insecure-skip-verify") {
		t.Errorf("String() = %q, want it to say verification is skipped", s)
	}
}

// TestSASLNeverPrintsItsPassword: the package promises passwords are never
// part of what it prints; a *SASL formatted by fmt or logged by slog
// printed its Password field.
func TestSASLNeverPrintsItsPassword(t *testing.T) {
	s := &kafkaconn.SASL{Mechanism: kafkaconn.Plain, Username: "u", Password: "hunter2"}
	var logged bytes.Buffer
	slog.New(slog.NewTextHandler(&logged, nil)).Info("conn", "sasl", s, "config", kafkaconn.Config{SASL: s})
	slog.New(slog.NewJSONHandler(&logged, nil)).Info("conn", "sasl", s, "config", kafkaconn.Config{SASL: s})
	if strings.Contains(logged.String(), "!ERROR") {
		t.Errorf("slog could not log a Config: %s", logged.String())
	}
	for _, out := range []string{fmt.Sprint(s), fmt.Sprintf("%v", *s), fmt.Sprintf("%+v", s), fmt.Sprintf("%#v", s),
		fmt.Sprintf("%+v", kafkaconn.Config{SASL: s}), logged.String()} {
		if strings.Contains(out, "hunter2") {
			t.Errorf("the password is printed: %s", out)
		}
	}
	if !strings.Contains(fmt.Sprint(s), "u") {
		t.Errorf("%v hides the user too", s)
	}
}

// TestAWSRegionFromMSKServerlessNames: MSK Serverless brokers are named
// boot-….c2.kafka-serverless.<region>.amazonaws.com; kafka-go's signer
// found no region in them (franz-go's did).
func TestAWSRegionFromMSKServerlessNames(t *testing.T) {
	t.Setenv("AWS_REGION", "")
	t.Setenv("AWS_DEFAULT_REGION", "")
	s := &kafkaconn.SASL{Mechanism: kafkaconn.AWSMSKIAM}
	for host, want := range map[string]string{
		"boot-abcd1234.c2.kafka-serverless.us-east-1.amazonaws.com:9098": "us-east-1",
		"b-1.demo.abc123.c2.kafka.eu-west-1.amazonaws.com:9098":          "eu-west-1",
		// The other AWS partitions franz-go's signer knows (helper 117:
		// the relay's start-up refusal must not refuse what it signs).
		"b-1.demo.abc123.c2.kafka.cn-north-1.amazonaws.com.cn:9098":  "cn-north-1",
		"b-1.demo.abc123.c1.kafka.us-iso-east-1.c2s.ic.gov:9098":     "us-iso-east-1",
		"b-1.demo.abc123.c1.kafka.us-isob-east-1.sc2s.sgov.gov:9098": "us-isob-east-1",
		"B-1.Demo.ABC123.C2.Kafka.EU-WEST-1.AmazonAWS.com:9098":      "eu-west-1", // DNS names ignore case
	} {
		if got, err := s.AWSRegionFor(host); err != nil || got != want {
			t.Errorf("AWSRegionFor(%s) = %q, %v; want %s", host, got, err, want)
		}
	}
	// helper 119: names franz-go cannot sign (it matches the partitions'
	// exact suffixes) carry no region here either: the relay then refuses
	// to start unless one is set, rather than fail every connection.
	for _, host := range []string{
		"b-1.demo.abc123.c2.kafka.us-east-1.amazonaws.com.:9098",
		"b-1.demo.abc123.c2.kafka.us-east-1.amazonaws.eu:9098",
	} {
		if got, err := s.AWSRegionFor(host); err == nil {
			t.Errorf("AWSRegionFor(%s) = %q, want an error (franz-go cannot sign it)", host, got)
		}
	}
}
