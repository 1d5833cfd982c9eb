// Package kafkagoconn turns a kafkaconn.Config into segmentio/kafka-go
// settings.
package kafkagoconn

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	signer "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/aws_msk_iam_v2"
	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/segmentio/kafka-go/sasl/scram"

	"github.com/onceflow/onceflow/kafkaconn"
)

// Settings validates c and returns its TLS configuration and SASL
// mechanism (each nil when unset).
func Settings(c kafkaconn.Config) (*tls.Config, sasl.Mechanism, error) {
	if err := c.Validate(); err != nil {
		return nil, nil, err
	}
	tc, err := c.TLSConfig()
	if err != nil {
		return nil, nil, err
	}
	if c.SASL == nil {
		return tc, nil, nil
	}
	m, err := Mechanism(c.SASL)
	if err != nil {
		return nil, nil, err
	}
	return tc, m, nil
}

// Transport returns a Transport for c (writers, the dead-letter writer).
func Transport(c kafkaconn.Config) (*kafka.Transport, error) {
	tc, m, err := Settings(c)
	if err != nil {
		return nil, err
	}
	return &kafka.Transport{TLS: tc, SASL: m, ClientID: c.ClientID}, nil
}

// Dialer returns a Dialer for c (readers), with kafka-go's default timeout.
func Dialer(c kafkaconn.Config) (*kafka.Dialer, error) {
	tc, m, err := Settings(c)
	if err != nil {
		return nil, err
	}
	return &kafka.Dialer{Timeout: 10 * time.Second, DualStack: true, TLS: tc, SASLMechanism: m, ClientID: c.ClientID}, nil
}

// TopicErrors asks the brokers at addr about topics by name, never
// creating one, connecting as like does (its dialer, TLS, SASL, client id,
// resolver; kafka-go's defaults when like is nil). It returns each topic's
// error as the broker answered it: nil for a topic that exists,
// kafka.TopicAuthorizationFailed for one the principal may not describe,
// kafka.UnknownTopicOrPartition for one that does not exist.
//
// kafka-go's Transport answers every metadata request that does not ask to
// create topics from its own list of all topics, and Kafka leaves out of
// that list the topics the principal may not describe: through it, a topic
// an ACL hides reads as unknown. A Transport whose MetadataTopics names the
// topics asks for them by name instead, without auto-creation. Each call
// dials its own connection, so it is for error paths, not every publish.
func TopicErrors(ctx context.Context, addr net.Addr, like *kafka.Transport, topics []string) (map[string]error, error) {
	probe := &kafka.Transport{MetadataTopics: topics}
	if like != nil {
		probe.Dial, probe.DialTimeout, probe.IdleTimeout = like.Dial, like.DialTimeout, like.IdleTimeout
		probe.ClientID, probe.TLS, probe.SASL = like.ClientID, like.TLS, like.SASL
		probe.Resolver, probe.Context = like.Resolver, like.Context
	}
	defer probe.CloseIdleConnections()
	cl := &kafka.Client{Addr: addr, Transport: probe}
	resp, err := cl.Metadata(ctx, &kafka.MetadataRequest{Addr: addr, Topics: topics})
	if err != nil {
		return nil, err
	}
	out := make(map[string]error, len(topics))
	for _, t := range resp.Topics {
		out[t.Name] = t.Error
	}
	for _, t := range topics {
		if _, ok := out[t]; !ok {
			return nil, fmt.Errorf("metadata by name: topic %q missing from the answer", t)
		}
	}
	return out, nil
}

// Mechanism returns kafka-go's mechanism for s.
func Mechanism(s *kafkaconn.SASL) (sasl.Mechanism, error) {
	switch s.Mechanism {
	case kafkaconn.Plain:
		return plain.Mechanism{Username: s.Username, Password: s.Password}, nil
	case kafkaconn.ScramSHA256:
		return scram.Mechanism(scram.SHA256, s.Username, s.Password)
	case kafkaconn.ScramSHA512:
		return scram.Mechanism(scram.SHA512, s.Username, s.Password)
	case kafkaconn.AWSMSKIAM:
		return &iam{s: s}, nil
	default:
		return nil, fmt.Errorf("SASL.Mechanism: %q is not supported", s.Mechanism)
	}
}

// iam is aws_msk_iam_v2's mechanism with the region chosen per broker
// (from its MSK host name) as franz-go does, and kafkaconn's credentials.
type iam struct{ s *kafkaconn.SASL }

func (m *iam) Name() string { return string(kafkaconn.AWSMSKIAM) }

func (m *iam) Start(ctx context.Context) (sasl.StateMachine, []byte, error) {
	mech, err := m.mechanism(ctx)
	if err != nil {
		return nil, nil, err
	}
	return mech.Start(ctx)
}

// IAMMechanism builds the aws_msk_iam_v2 mechanism used to dial the broker
// named in ctx's SASL metadata (exported to the package's tests).
func (m *iam) mechanism(ctx context.Context) (*aws_msk_iam_v2.Mechanism, error) {
	host := ""
	if md := sasl.MetadataFromContext(ctx); md != nil {
		host = md.Host
	}
	region, err := m.s.AWSRegionFor(host)
	if err != nil {
		return nil, err
	}
	creds := m.s.AWSCredentials
	if creds == nil {
		creds = kafkaconn.EnvAWSCredentials
	}
	return &aws_msk_iam_v2.Mechanism{
		Signer: signer.NewSigner(),
		Region: region,
		Credentials: aws.CredentialsProviderFunc(func(ctx context.Context) (aws.Credentials, error) {
			c, err := creds(ctx)
			if err != nil {
				return aws.Credentials{}, err
			}
			return aws.Credentials{AccessKeyID: c.AccessKeyID, SecretAccessKey: c.SecretAccessKey, SessionToken: c.SessionToken, Source: "onceflow"}, nil
		}),
	}, nil
}
