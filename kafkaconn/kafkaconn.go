package kafkaconn

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
)

// Config says how to reach the brokers. The zero Config is plaintext
// without authentication. A Config is a value: copy it freely; it is safe
// for concurrent use once built.
type Config struct {
	// ClientID names the client to the brokers (their logs, quotas and
	// request metrics). Defaults to each client's own default ("kgo" for
	// franz-go, "kafka-go" hostname-based for segmentio/kafka-go) unless the
	// adapter documents another.
	ClientID string
	// TLS, when non-nil, encrypts every connection. &TLS{} verifies the
	// brokers against the system's roots. Defaults to nil: plaintext.
	TLS *TLS
	// SASL, when non-nil, authenticates every connection. Use it over TLS
	// except in tests: PLAIN sends the password as it is. Defaults to nil:
	// no authentication.
	SASL *SASL
}

// TLS configures encryption and, with a client certificate, mutual TLS.
type TLS struct {
	// CAFile is a PEM file of the certificate authorities that signed the
	// brokers' certificates. Defaults to "": the system's roots.
	CAFile string
	// CertFile and KeyFile are a PEM client certificate and its key, for
	// brokers that require mutual TLS (ssl.client.auth=required). Both or
	// neither. They are read for every new connection, so a certificate
	// rotated in place is used without a restart (CAFile is read once).
	// Default to "": no client certificate.
	CertFile string
	KeyFile  string
	// ServerName is the name the brokers' certificates must carry.
	// Defaults to "": the host of the address dialed.
	ServerName string
	// InsecureSkipVerify accepts any certificate the brokers present. For
	// tests only: it gives up the protection TLS exists for. Defaults to
	// false.
	InsecureSkipVerify bool
}

// Mechanism is a SASL mechanism name as Kafka spells it.
type Mechanism string

// The SASL mechanisms every adapter supports.
const (
	Plain       Mechanism = "PLAIN"
	ScramSHA256 Mechanism = "SCRAM-SHA-256"
	ScramSHA512 Mechanism = "SCRAM-SHA-512"
	AWSMSKIAM   Mechanism = "AWS_MSK_IAM"
)

// Mechanisms lists the supported mechanisms, for help texts.
var Mechanisms = []Mechanism{Plain, ScramSHA256, ScramSHA512, AWSMSKIAM}

// ParseMechanism accepts a mechanism name in any letter case.
func ParseMechanism(s string) (Mechanism, error) {
	for _, m := range Mechanisms {
		if strings.EqualFold(s, string(m)) {
			return m, nil
		}
	}
	return "", fmt.Errorf("%q is not one of %s", s, mechanismList())
}

func mechanismList() string {
	names := make([]string, len(Mechanisms))
	for i, m := range Mechanisms {
		names[i] = string(m)
	}
	return strings.Join(names, ", ")
}

// SASL configures authentication.
type SASL struct {
	// Mechanism is PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or AWS_MSK_IAM.
	// Required.
	Mechanism Mechanism
	// Username and Password are the credentials of PLAIN and SCRAM.
	// Required for them (Password or PasswordFile); unused by AWS_MSK_IAM.
	Username string
	Password string
	// PasswordFile, instead of Password, is a file holding the password
	// (one trailing newline is ignored). It is read for every new
	// connection, so a secret rotated in place (a mounted Kubernetes or
	// Vault secret) is used without a restart once the old one is refused.
	PasswordFile string
	// AWSCredentials returns the credentials AWS_MSK_IAM signs with; it is
	// called for every new connection, so it may rotate them. Defaults to
	// reading AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN
	// from the environment.
	AWSCredentials func(context.Context) (AWSCredentials, error)
	// AWSRegion is the cluster's region, signed into AWS_MSK_IAM's
	// request, for brokers whose host name does not carry it (an MSK name
	// does: ….kafka.eu-west-1.amazonaws.com). franz-go reads it only from
	// the environment: with the kgo adapters a non-MSK host name needs
	// AWS_REGION. Defaults to AWS_REGION, then AWS_DEFAULT_REGION.
	AWSRegion string
}

// CurrentPassword returns Password, or PasswordFile's content as it is now
// (one trailing newline, and a carriage return before it, trimmed). The
// adapters call it for every new connection.
func (s *SASL) CurrentPassword() (string, error) {
	if s.PasswordFile == "" {
		return s.Password, nil
	}
	b, err := os.ReadFile(s.PasswordFile)
	if err != nil {
		return "", fmt.Errorf("SASL.PasswordFile: %w", err)
	}
	password := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
	if password == "" {
		return "", fmt.Errorf("SASL.PasswordFile: %s is empty", s.PasswordFile)
	}
	return password, nil
}

// AWSCredentials are what AWS_MSK_IAM signs with.
type AWSCredentials struct {
	AccessKeyID     string
	SecretAccessKey string
	SessionToken    string // empty for long-lived keys
}

// String describes the Config for logs: the mechanism and user, never a
// password.
func (c Config) String() string {
	var parts []string
	switch {
	case c.TLS == nil:
		parts = append(parts, "plaintext")
	case c.TLS.InsecureSkipVerify:
		parts = append(parts, "tls insecure-skip-verify")
	default:
		parts = append(parts, "tls")
	}
	if c.TLS != nil && c.TLS.CertFile != "" {
		parts = append(parts, "client-cert")
	}
	if c.SASL != nil {
		parts = append(parts, c.SASL.String())
	}
	return strings.Join(parts, " ")
}

// LogValue keeps log/slog's JSON handler from failing on the credentials
// function and its text handler from printing fields: the Config's String.
func (c Config) LogValue() slog.Value { return slog.StringValue(c.String()) }

// String describes the SASL settings: the mechanism and user, never the
// password (fmt's %v and %+v print this too).
func (s SASL) String() string {
	out := "sasl=" + string(s.Mechanism)
	if s.Username != "" {
		out += " user=" + s.Username
	}
	return out
}

// GoString keeps %#v from printing the password.
func (s SASL) GoString() string { return "kafkaconn.SASL{" + s.String() + "}" }

// LogValue keeps log/slog from printing the password.
func (s SASL) LogValue() slog.Value { return slog.StringValue(s.String()) }

// Validate checks the Config: required fields, files that exist and parse.
// Errors name the field, e.g. "SASL.Username: required for SCRAM-SHA-512".
func (c Config) Validate() error {
	if c.TLS != nil {
		if t := c.TLS; t.InsecureSkipVerify && t.CAFile != "" {
			// Skipping verification drops what the CA file asks to
			// verify: a setting left over from a test would silently
			// weaken a production one. (ServerName still sets SNI, which
			// a proxy may route on: allowed.)
			return errors.New("TLS.InsecureSkipVerify: skips the verification TLS.CAFile asks for; set one or the other")
		}
		if _, err := c.TLSConfig(); err != nil {
			return err
		}
	}
	if c.SASL != nil {
		s := c.SASL
		switch s.Mechanism {
		case Plain, ScramSHA256, ScramSHA512:
			if s.Username == "" {
				return fmt.Errorf("SASL.Username: required for %s", s.Mechanism)
			}
			switch {
			case s.Password != "" && s.PasswordFile != "":
				return errors.New("SASL.Password, SASL.PasswordFile: set one")
			case s.Password == "" && s.PasswordFile == "":
				return fmt.Errorf("SASL.Password: required for %s", s.Mechanism)
			}
			if _, err := s.CurrentPassword(); err != nil {
				return err
			}
		case AWSMSKIAM:
			if s.Username != "" || s.Password != "" || s.PasswordFile != "" {
				return errors.New("SASL.Username, SASL.Password, SASL.PasswordFile: unused by AWS_MSK_IAM (it signs with AWS credentials); leave them empty")
			}
		case "":
			return fmt.Errorf("SASL.Mechanism: required (%s)", mechanismList())
		default:
			return fmt.Errorf("SASL.Mechanism: %q is not one of %s", s.Mechanism, mechanismList())
		}
	}
	return nil
}

// TLSConfig builds the crypto/tls configuration, reading CAFile, CertFile
// and KeyFile. It returns nil, nil when TLS is nil.
func (c Config) TLSConfig() (*tls.Config, error) {
	t := c.TLS
	if t == nil {
		return nil, nil
	}
	out := &tls.Config{
		MinVersion:         tls.VersionTLS12,
		ServerName:         t.ServerName,
		InsecureSkipVerify: t.InsecureSkipVerify, //nolint:gosec // explicit opt-in, documented as tests only
	}
	if t.CAFile != "" {
		pem, err := os.ReadFile(t.CAFile)
		if err != nil {
			return nil, fmt.Errorf("TLS.CAFile: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("TLS.CAFile: %s holds no PEM certificate", t.CAFile)
		}
		out.RootCAs = pool
	}
	switch {
	case t.CertFile != "" && t.KeyFile != "":
		load := func() (*tls.Certificate, error) {
			cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
			if err != nil {
				return nil, fmt.Errorf("TLS.CertFile, TLS.KeyFile: %w", err)
			}
			return &cert, nil
		}
		if _, err := load(); err != nil {
			return nil, err
		}
		// Read at every handshake: a certificate rotated in place is
		// presented on the next connection. A pair caught half-written
		// fails that handshake, and the client dials again.
		out.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return load() }
	case t.CertFile != "":
		return nil, errors.New("TLS.KeyFile: required with TLS.CertFile")
	case t.KeyFile != "":
		return nil, errors.New("TLS.CertFile: required with TLS.KeyFile")
	}
	return out, nil
}

// EnvAWSCredentials reads AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
// AWS_SESSION_TOKEN; it is SASL.AWSCredentials' default.
func EnvAWSCredentials(context.Context) (AWSCredentials, error) {
	c := AWSCredentials{
		AccessKeyID:     os.Getenv("AWS_ACCESS_KEY_ID"),
		SecretAccessKey: os.Getenv("AWS_SECRET_ACCESS_KEY"),
		SessionToken:    os.Getenv("AWS_SESSION_TOKEN"),
	}
	if c.AccessKeyID == "" || c.SecretAccessKey == "" {
		return c, errors.New("kafkaconn: AWS_MSK_IAM: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not set (or set SASL.AWSCredentials)")
	}
	return c, nil
}

// AWSRegionFor returns the region AWS_MSK_IAM signs for when dialing
// host: the region in an MSK broker name
// (b-1.cluster.abc123.c2.kafka.eu-west-1.amazonaws.com), else
// SASL.AWSRegion, AWS_REGION, AWS_DEFAULT_REGION.
func (s *SASL) AWSRegionFor(host string) (string, error) {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	labels := strings.Split(strings.ToLower(host), ".") // DNS names ignore case
	for i := 0; i+2 < len(labels); i++ {
		// MSK provisioned (….kafka.<region>.amazonaws.com) and Serverless
		// (….kafka-serverless.<region>.amazonaws.com) broker names.
		// The domain after the region is one of AWS's partitions, as
		// franz-go's signer matches them (no trailing dot): what it
		// cannot sign must not pass for signable here.
		domain := strings.Join(labels[i+2:], ".")
		aws := domain == "amazonaws.com" || domain == "amazonaws.com.cn" || domain == "c2s.ic.gov" || domain == "sc2s.sgov.gov"
		if (labels[i] == "kafka" || labels[i] == "kafka-serverless") && aws && labels[i+1] != "" {
			return labels[i+1], nil
		}
	}
	if s.AWSRegion != "" {
		return s.AWSRegion, nil
	}
	for _, v := range []string{"AWS_REGION", "AWS_DEFAULT_REGION"} {
		if r := os.Getenv(v); r != "" {
			return r, nil
		}
	}
	return "", fmt.Errorf("kafkaconn: AWS_MSK_IAM: no region for %s: set SASL.AWSRegion or AWS_REGION", host)
}
