package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/aws/aws-sdk-go-v2/aws"
	awsconfig "github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/smithy-go/logging"

	"github.com/onceflow/onceflow/kafkaconn"
)

// awsHTTPClient, when set (by tests), is the HTTP client the AWS SDK uses
// for STS and the container and instance endpoints.
var awsHTTPClient aws.HTTPClient

// awsCredentialChain returns AWS_MSK_IAM's credentials for the binary: the
// AWS SDK's default chain (the environment's keys, the shared config and
// credentials files under AWS_PROFILE, web identity as EKS service
// accounts use, ECS and EKS Pod Identity container credentials, the EC2
// instance role), cached and refreshed before they expire. kafkaconn's
// default reads the environment's keys only, which the roles MSK users
// run with never set. region (the brokers' or --kafka-aws-region, "" for
// none) is the SDK's region when neither AWS_REGION nor the profile names
// one (web identity and assumed roles call regional STS); the flag, when
// given, has been set as AWS_REGION already, so it wins.
//
// The configuration is loaded now (files and the environment, no network):
// an error there (a profile that does not exist, a malformed file) cannot
// heal, so it is returned for the relay to refuse to start. Credentials are
// fetched on each call, which may fail and heal (a role not ready yet).
func awsCredentialChain(region string) (func(context.Context) (kafkaconn.AWSCredentials, error), error) {
	opts := []func(*awsconfig.LoadOptions) error{
		// The SDK's own log lines (an IMDSv1 fallback, say) would go to
		// stderr past the relay's log format.
		awsconfig.WithLogger(logging.Nop{}),
	}
	if region != "" {
		opts = append(opts, awsconfig.WithDefaultRegion(region))
	}
	if awsHTTPClient != nil {
		opts = append(opts, awsconfig.WithHTTPClient(awsHTTPClient))
	}
	cfg, err := awsconfig.LoadDefaultConfig(context.Background(), opts...)
	if err != nil {
		return nil, fmt.Errorf("load the AWS configuration: %w", err)
	}
	provider := cfg.Credentials
	if provider == nil {
		return nil, errors.New("the AWS configuration names no credentials provider")
	}
	return func(ctx context.Context) (kafkaconn.AWSCredentials, error) {
		c, err := provider.Retrieve(ctx)
		if err != nil {
			return kafkaconn.AWSCredentials{}, fmt.Errorf("AWS_MSK_IAM: no AWS credentials (looked in the environment, the shared files under AWS_PROFILE, web identity, container and instance roles): %w", err)
		}
		return kafkaconn.AWSCredentials{AccessKeyID: c.AccessKeyID, SecretAccessKey: c.SecretAccessKey, SessionToken: c.SessionToken}, nil
	}, nil
}
