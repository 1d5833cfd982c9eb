package main

import (
	"context"
	"flag"
	"io"
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
