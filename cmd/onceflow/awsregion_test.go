package main

import (
	"context"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/kgoconn"
)

// TestKafkaAWSRegionReachesFranzGo: --kafka-aws-region is the region
// AWS_MSK_IAM signs for when the broker's host name does not carry one. The
// kafka-go publisher took it from the flag, but franz-go's mechanism (the
// default publisher's) reads only the host name and AWS_REGION, so the flag
// did nothing there and every connection failed to authenticate with
// "cannot determine the region".
func TestKafkaAWSRegionReachesFranzGo(t *testing.T) {
	t.Setenv("AWS_REGION", "")
	t.Setenv("AWS_DEFAULT_REGION", "")
	t.Setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "secret")
	t.Setenv("ONCEFLOW_KAFKA_AWS_REGION", "")
	var kf kafkaFlags
	fs := flag.NewFlagSet("relay", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	kf.register(fs)
	if err := fs.Parse([]string{"--kafka-sasl-mechanism", "AWS_MSK_IAM", "--kafka-aws-region", "us-east-2"}); err != nil {
		t.Fatal(err)
	}
	const host = "kafka.internal:9098" // a private name: no region in it
	_, conn, err := kf.conn([]string{"SASL_SSL://" + host})
	if err != nil {
		t.Fatal(err)
	}
	m, err := kgoconn.Mechanism(conn.SASL)
	if err != nil {
		t.Fatal(err)
	}
	_, first, err := m.Authenticate(context.Background(), host)
	if err != nil {
		t.Fatalf("franz-go's AWS_MSK_IAM with --kafka-aws-region us-east-2: %v", err)
	}
	if !strings.Contains(string(first), "/us-east-2/kafka-cluster/aws4_request") {
		t.Fatalf("franz-go signed for another region: %s", first)
	}
}

// TestMSKIAMTakesTheAWSCredentialChain: the binary signed AWS_MSK_IAM only
// with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY from its environment,
// so the credentials MSK users run with (an EKS service account's role, an
// ECS task role, an instance profile, a named profile) failed every
// connection. It now takes the AWS SDK's default chain; a shared
// credentials file under AWS_PROFILE stands in for them here.
func TestMSKIAMTakesTheAWSCredentialChain(t *testing.T) {
	dir := t.TempDir()
	creds := filepath.Join(dir, "credentials")
	if err := os.WriteFile(creds, []byte("[msk-relay]\naws_access_key_id = AKIDPROFILE\naws_secret_access_key = secretprofile\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{
		"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SESSION_TOKEN": "",
		"AWS_SHARED_CREDENTIALS_FILE": creds, "AWS_CONFIG_FILE": filepath.Join(dir, "none"),
		"AWS_PROFILE": "msk-relay", "AWS_EC2_METADATA_DISABLED": "true", "AWS_REGION": "", "AWS_DEFAULT_REGION": "",
		"ONCEFLOW_KAFKA_AWS_REGION": "",
	} {
		t.Setenv(k, v)
	}
	var kf kafkaFlags
	fs := flag.NewFlagSet("relay", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	kf.register(fs)
	if err := fs.Parse([]string{"--kafka-sasl-mechanism", "AWS_MSK_IAM"}); err != nil {
		t.Fatal(err)
	}
	const host = "b-1.demo.abc123.c2.kafka.eu-west-1.amazonaws.com:9098"
	_, conn, err := kf.conn([]string{"SASL_SSL://" + host})
	if err != nil {
		t.Fatal(err)
	}
	m, err := kgoconn.Mechanism(conn.SASL)
	if err != nil {
		t.Fatal(err)
	}
	_, first, err := m.Authenticate(context.Background(), host)
	if err != nil {
		t.Fatalf("AWS_MSK_IAM with credentials from a profile: %v", err)
	}
	if !strings.Contains(string(first), `AKIDPROFILE/`) {
		t.Fatalf("signed with other credentials than the profile's: %s", first)
	}
}

// TestMSKIAMWithoutCredentialsFailsAtStart: with no credentials anywhere
// the relay exits at start saying so, rather than run with every broker
// connection failing.
func TestMSKIAMWithoutCredentialsFailsAtStart(t *testing.T) {
	dir := t.TempDir()
	for k, v := range map[string]string{
		"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SESSION_TOKEN": "", "AWS_PROFILE": "",
		"AWS_SHARED_CREDENTIALS_FILE": filepath.Join(dir, "none"), "AWS_CONFIG_FILE": filepath.Join(dir, "none"),
		"AWS_EC2_METADATA_DISABLED": "true", "AWS_WEB_IDENTITY_TOKEN_FILE": "", "AWS_CONTAINER_CREDENTIALS_FULL_URI": "",
		"AWS_CONTAINER_CREDENTIALS_RELATIVE_URI": "", "ONCEFLOW_KAFKA_AWS_REGION": "",
	} {
		t.Setenv(k, v)
	}
	_, err := runCLI(t, "relay", "--database-url", "postgres://postgres@127.0.0.1:1/x", "--wait-for-database=false",
		"--brokers", "SASL_SSL://b-1.demo.abc123.c2.kafka.eu-west-1.amazonaws.com:9098", "--kafka-sasl-mechanism", "AWS_MSK_IAM")
	if err == nil || !strings.Contains(err.Error(), "no AWS credentials") {
		t.Fatalf("err = %v, want the relay to stop at start for want of AWS credentials", err)
	}
}
