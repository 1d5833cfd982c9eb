package main

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/aws/aws-sdk-go-v2/aws"
	awsconfig "github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/smithy-go/logging"

	"github.com/onceflow/onceflow/kafkaconn"
)

// awsCredentialChain returns AWS_MSK_IAM's credentials for the binary: the
// AWS SDK's default chain (the environment's keys, the shared config and
// credentials files under AWS_PROFILE, web identity as EKS service
// accounts use, ECS and EKS Pod Identity container credentials, the EC2
// instance role), cached and refreshed before they expire. kafkaconn's
// default reads the environment's keys only, which the roles MSK users
// run with never set. region (the brokers' or --kafka-aws-region, "" for
// none) is the SDK's region unless AWS_REGION or the profile names one:
// web identity and assumed roles call regional STS.
func awsCredentialChain(region string) func(context.Context) (kafkaconn.AWSCredentials, error) {
	var (
		once     sync.Once
		provider aws.CredentialsProvider
		loadErr  error
	)
	return func(ctx context.Context) (kafkaconn.AWSCredentials, error) {
		once.Do(func() {
			// Reads files and the environment only; credentials are
			// fetched on Retrieve.
			opts := []func(*awsconfig.LoadOptions) error{
				// The SDK's own log lines (an IMDSv1 fallback, say) would
				// go to stderr past the relay's log format.
				awsconfig.WithLogger(logging.Nop{}),
			}
			if region != "" {
				opts = append(opts, awsconfig.WithDefaultRegion(region))
			}
			cfg, err := awsconfig.LoadDefaultConfig(context.Background(), opts...)
			provider, loadErr = cfg.Credentials, err
		})
		if loadErr != nil {
			return kafkaconn.AWSCredentials{}, fmt.Errorf("AWS_MSK_IAM: load the AWS configuration: %w", loadErr)
		}
		if provider == nil {
			return kafkaconn.AWSCredentials{}, errors.New("AWS_MSK_IAM: no AWS credentials provider configured")
		}
		c, err := provider.Retrieve(ctx)
		if err != nil {
			return kafkaconn.AWSCredentials{}, fmt.Errorf("AWS_MSK_IAM: no AWS credentials (looked in the environment, the shared files under AWS_PROFILE, web identity, container and instance roles): %w", err)
		}
		return kafkaconn.AWSCredentials{AccessKeyID: c.AccessKeyID, SecretAccessKey: c.SecretAccessKey, SessionToken: c.SessionToken}, nil
	}
}
