package main

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/onceflow/onceflow/kafkaconn"
)

// kafkaFlags are the relay's Kafka connection and producer flags.
type kafkaFlags struct {
	tls, tlsInsecure                             bool
	caFile, certFile, keyFile, serverName        string
	mechanism, username, passwordFile, awsRegion string
	clientID, compression                        string
	maxRecordBytes                               int
	linger                                       time.Duration
}

// kafkaEnvBool reads a boolean environment variable (1, true, …).
func kafkaEnvBool(name string) bool { return kafkaEnvBoolDefault(name, false) }

func kafkaEnvBoolDefault(name string, fallback bool) bool {
	v, ok := os.LookupEnv(name)
	if !ok || v == "" {
		return fallback
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		envErrs = append(envErrs, &badEnv{name, v, "true or false"})
	}
	return b
}

func (k *kafkaFlags) register(fs *flag.FlagSet) {
	fs.BoolVar(&k.tls, "kafka-tls", kafkaEnvBool("ONCEFLOW_KAFKA_TLS"), "connect to the brokers with TLS (implied by the other --kafka-tls-* flags and by SSL:// or SASL_SSL:// brokers) (env ONCEFLOW_KAFKA_TLS)")
	fs.StringVar(&k.caFile, "kafka-tls-ca-file", env("ONCEFLOW_KAFKA_TLS_CA_FILE", ""), "PEM file of the CAs that signed the brokers' certificates; default the system's (env ONCEFLOW_KAFKA_TLS_CA_FILE)")
	fs.StringVar(&k.certFile, "kafka-tls-cert-file", env("ONCEFLOW_KAFKA_TLS_CERT_FILE", ""), "PEM client certificate, for mutual TLS (env ONCEFLOW_KAFKA_TLS_CERT_FILE)")
	fs.StringVar(&k.keyFile, "kafka-tls-key-file", env("ONCEFLOW_KAFKA_TLS_KEY_FILE", ""), "PEM key of --kafka-tls-cert-file (env ONCEFLOW_KAFKA_TLS_KEY_FILE)")
	fs.StringVar(&k.serverName, "kafka-tls-server-name", env("ONCEFLOW_KAFKA_TLS_SERVER_NAME", ""), "name the brokers' certificates must carry; default the broker's host (env ONCEFLOW_KAFKA_TLS_SERVER_NAME)")
	fs.BoolVar(&k.tlsInsecure, "kafka-tls-insecure-skip-verify", kafkaEnvBool("ONCEFLOW_KAFKA_TLS_INSECURE_SKIP_VERIFY"), "accept any broker certificate: for tests only (env ONCEFLOW_KAFKA_TLS_INSECURE_SKIP_VERIFY)")
	fs.StringVar(&k.mechanism, "kafka-sasl-mechanism", env("ONCEFLOW_KAFKA_SASL_MECHANISM", ""), "SASL mechanism: PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or AWS_MSK_IAM; empty: none (env ONCEFLOW_KAFKA_SASL_MECHANISM)")
	fs.StringVar(&k.username, "kafka-sasl-username", env("ONCEFLOW_KAFKA_SASL_USERNAME", ""), "SASL user for PLAIN and SCRAM (env ONCEFLOW_KAFKA_SASL_USERNAME)")
	fs.StringVar(&k.passwordFile, "kafka-sasl-password-file", env("ONCEFLOW_KAFKA_SASL_PASSWORD_FILE", ""), "file holding the SASL password (one trailing newline is ignored); or set ONCEFLOW_KAFKA_SASL_PASSWORD. There is no password flag: command lines show in ps (env ONCEFLOW_KAFKA_SASL_PASSWORD_FILE)")
	fs.StringVar(&k.awsRegion, "kafka-aws-region", env("ONCEFLOW_KAFKA_AWS_REGION", ""), "AWS_MSK_IAM: the cluster's region when the broker names do not carry it; default AWS_REGION. Credentials come from the AWS SDK's default chain: the environment's keys, AWS_PROFILE's shared files, web identity (EKS service accounts), ECS and EKS Pod Identity, the EC2 instance role (env ONCEFLOW_KAFKA_AWS_REGION)")
	fs.StringVar(&k.clientID, "kafka-client-id", env("ONCEFLOW_KAFKA_CLIENT_ID", "onceflow-relay"), "client id shown in the brokers' logs, quotas and metrics (env ONCEFLOW_KAFKA_CLIENT_ID)")
	fs.StringVar(&k.compression, "compression", env("ONCEFLOW_COMPRESSION", ""), "produce compression: none, gzip, snappy, lz4 or zstd; default the client's (snappy for franz-go, none for kafka-go) (env ONCEFLOW_COMPRESSION)")
	fs.IntVar(&k.maxRecordBytes, "max-record-bytes", envInt("ONCEFLOW_MAX_RECORD_BYTES", 1000012), "largest record the relay sends; a larger one is dead-lettered. Keep at or below the topics' max.message.bytes (env ONCEFLOW_MAX_RECORD_BYTES)")
	fs.DurationVar(&k.linger, "linger", envDuration("ONCEFLOW_LINGER", 0), "how long the producer waits to fill a batch, shorter than --publish-timeout; franz-go default 0 (at most 1m), kafka-go 1ms (env ONCEFLOW_LINGER)")
}

// conn checks the flags against the brokers' listener prefix
// (SASL_SSL://host:port) and returns the plain host:port list and the
// connection settings. Errors name the flag.
func (k *kafkaFlags) conn(brokers []string) ([]string, kafkaconn.Config, error) {
	hosts, proto, err := kafkaconn.ParseBrokers(brokers)
	if err != nil {
		return nil, kafkaconn.Config{}, fmt.Errorf("--brokers: %w", err)
	}
	c := kafkaconn.Config{ClientID: k.clientID}
	wantTLS := k.tls || k.caFile != "" || k.certFile != "" || k.keyFile != "" || k.serverName != "" || k.tlsInsecure
	switch {
	case proto != "" && !proto.TLS() && wantTLS:
		return nil, c, fmt.Errorf("--brokers: %s:// listeners are not TLS, but --kafka-tls flags are set; use SSL:// or SASL_SSL://", proto)
	case proto != "" && !proto.SASL() && k.mechanism != "":
		return nil, c, fmt.Errorf("--brokers: %s:// listeners have no SASL, but --kafka-sasl-mechanism is set; use SASL_SSL:// or SASL_PLAINTEXT://", proto)
	case proto.SASL() && k.mechanism == "":
		return nil, c, fmt.Errorf("--kafka-sasl-mechanism: required by %s:// brokers (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or AWS_MSK_IAM)", proto)
	}
	if wantTLS || proto.TLS() {
		c.TLS = &kafkaconn.TLS{CAFile: k.caFile, CertFile: k.certFile, KeyFile: k.keyFile, ServerName: k.serverName, InsecureSkipVerify: k.tlsInsecure}
	}
	if k.awsRegion != "" && !strings.EqualFold(k.mechanism, string(kafkaconn.AWSMSKIAM)) {
		return nil, c, errors.New("--kafka-aws-region: used only with --kafka-sasl-mechanism AWS_MSK_IAM")
	}
	// One trailing newline is dropped, as from the password file: a secret
	// made with `echo … | base64` carries one.
	password := trimNewline(os.Getenv("ONCEFLOW_KAFKA_SASL_PASSWORD"))
	username := trimNewline(k.username)
	fromEnv := password != "" // empty counts as unset, as for every setting
	if k.mechanism == "" {
		if username != "" || k.passwordFile != "" || fromEnv {
			return nil, c, errors.New("--kafka-sasl-mechanism: required when a SASL user or password is given")
		}
	} else {
		m, err := kafkaconn.ParseMechanism(k.mechanism)
		if err != nil {
			return nil, c, fmt.Errorf("--kafka-sasl-mechanism: %w", err)
		}
		if k.passwordFile != "" {
			if fromEnv {
				return nil, c, errors.New("--kafka-sasl-password-file: ONCEFLOW_KAFKA_SASL_PASSWORD is set too; give one")
			}
		}
		// The file is read for every new connection (Validate reads it
		// once now): a secret rotated in place is used without a restart.
		c.SASL = &kafkaconn.SASL{Mechanism: m, Username: username, Password: password, PasswordFile: k.passwordFile, AWSRegion: k.awsRegion}
		if m == kafkaconn.AWSMSKIAM {
			region := k.awsRegion
			if region != "" {
				// franz-go's AWS_MSK_IAM takes the region from the broker's
				// host name, else from AWS_REGION only (it has no setting
				// for it); this process's AWS_REGION is the flag's way to
				// reach it. kafka-go reads SASL.AWSRegion, which wins over
				// AWS_REGION too.
				if err := os.Setenv("AWS_REGION", region); err != nil {
					return nil, c, fmt.Errorf("--kafka-aws-region: %w", err)
				}
			} else {
				// A broker name without a region, and none in the
				// environment, fails every connection for good: refused now.
				for _, h := range hosts {
					if _, err := c.SASL.AWSRegionFor(h); err != nil {
						return nil, c, fmt.Errorf("--kafka-aws-region: required: broker %s's name carries no region, and AWS_REGION and AWS_DEFAULT_REGION are unset", h)
					}
				}
				if len(hosts) > 0 {
					region, _ = c.SASL.AWSRegionFor(hosts[0])
				}
			}
			creds, err := awsCredentialChain(region)
			if err != nil {
				return nil, c, fmt.Errorf("--kafka-sasl-mechanism AWS_MSK_IAM: %w", err)
			}
			c.SASL.AWSCredentials = creds
		}
	}
	if err := c.Validate(); err != nil {
		return nil, c, errors.New(flagNames(err.Error()))
	}
	return hosts, c, nil
}

// flagNames renames kafkaconn's fields in an error as the flags that set
// them.
func flagNames(s string) string {
	return strings.NewReplacer(
		"TLS.InsecureSkipVerify", "--kafka-tls-insecure-skip-verify",
		"TLS.ServerName", "--kafka-tls-server-name",
		"TLS.CAFile", "--kafka-tls-ca-file",
		"TLS.CertFile", "--kafka-tls-cert-file",
		"TLS.KeyFile", "--kafka-tls-key-file",
		"SASL.Mechanism", "--kafka-sasl-mechanism",
		"SASL.Username", "--kafka-sasl-username",
		"SASL.PasswordFile", "--kafka-sasl-password-file", // before its prefix
		"SASL.Password", "ONCEFLOW_KAFKA_SASL_PASSWORD (or --kafka-sasl-password-file)",
	).Replace(s)
}

// check validates the producer settings.
func (k *kafkaFlags) check() error {
	switch k.compression {
	case "", "none", "gzip", "snappy", "lz4", "zstd":
	default:
		return fmt.Errorf("--compression: %q is not none, gzip, snappy, lz4 or zstd", k.compression)
	}
	if k.maxRecordBytes < 1024 || k.maxRecordBytes > 1<<30 {
		return fmt.Errorf("--max-record-bytes: %d is not between 1024 and 1073741824", k.maxRecordBytes)
	}
	if k.linger < 0 {
		return fmt.Errorf("--linger: %s is negative", k.linger)
	}
	return nil
}

// warnWeakKafkaSecurity says at start what a reader of the settings could
// miss: certificates not verified, or SASL credentials sent in the clear.
func warnWeakKafkaSecurity(log *slog.Logger, c kafkaconn.Config) {
	if c.TLS != nil && c.TLS.InsecureSkipVerify {
		log.Warn("relay: the brokers' certificates are not verified (--kafka-tls-insecure-skip-verify): for tests only")
	}
	if c.TLS == nil && c.SASL != nil && c.SASL.Mechanism == kafkaconn.Plain {
		log.Warn("relay: SASL PLAIN without TLS sends the password in the clear; use SASL_SSL:// brokers or --kafka-tls")
	}
	if c.TLS == nil && c.SASL != nil && c.SASL.Mechanism == kafkaconn.AWSMSKIAM {
		log.Warn("relay: AWS_MSK_IAM without TLS: MSK serves IAM on its TLS listener only (port 9098), and the signed token goes in the clear; use SASL_SSL:// brokers or --kafka-tls")
	}
}

// trimNewline drops one trailing newline, and a carriage return before it.
func trimNewline(s string) string {
	return strings.TrimSuffix(strings.TrimSuffix(s, "\n"), "\r")
}
