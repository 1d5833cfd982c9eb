// Package kgoconn turns a kafkaconn.Config into franz-go options.
package kgoconn

import (
	"context"
	"fmt"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/aws"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/onceflow/onceflow/kafkaconn"
)

// Opts validates c and returns the kgo options for it.
func Opts(c kafkaconn.Config) ([]kgo.Opt, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	var opts []kgo.Opt
	if c.ClientID != "" {
		opts = append(opts, kgo.ClientID(c.ClientID))
	}
	tc, err := c.TLSConfig()
	if err != nil {
		return nil, err
	}
	if tc != nil {
		opts = append(opts, kgo.DialTLSConfig(tc))
	}
	if c.SASL != nil {
		m, err := Mechanism(c.SASL)
		if err != nil {
			return nil, err
		}
		opts = append(opts, kgo.SASL(m))
	}
	return opts, nil
}

// Mechanism returns franz-go's mechanism for s.
func Mechanism(s *kafkaconn.SASL) (sasl.Mechanism, error) {
	switch s.Mechanism {
	// The password is read for every connection (SASL.PasswordFile may be
	// rotated in place).
	case kafkaconn.Plain:
		return plain.Plain(func(context.Context) (plain.Auth, error) {
			pw, err := s.CurrentPassword()
			return plain.Auth{User: s.Username, Pass: pw}, err
		}), nil
	case kafkaconn.ScramSHA256:
		return scram.Sha256(func(context.Context) (scram.Auth, error) {
			pw, err := s.CurrentPassword()
			return scram.Auth{User: s.Username, Pass: pw}, err
		}), nil
	case kafkaconn.ScramSHA512:
		return scram.Sha512(func(context.Context) (scram.Auth, error) {
			pw, err := s.CurrentPassword()
			return scram.Auth{User: s.Username, Pass: pw}, err
		}), nil
	case kafkaconn.AWSMSKIAM:
		creds := s.AWSCredentials
		if creds == nil {
			creds = kafkaconn.EnvAWSCredentials
		}
		return aws.ManagedStreamingIAM(func(ctx context.Context) (aws.Auth, error) {
			c, err := creds(ctx)
			if err != nil {
				return aws.Auth{}, err
			}
			return aws.Auth{AccessKey: c.AccessKeyID, SecretKey: c.SecretAccessKey, SessionToken: c.SessionToken}, nil
		}), nil
	default:
		return nil, fmt.Errorf("SASL.Mechanism: %q is not supported", s.Mechanism)
	}
}
