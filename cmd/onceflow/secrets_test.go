package main

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/kafkaconn"
)

// TestHelpDoesNotPrintTheDatabasePassword: a flag's default is printed by
// --help, and --database-url's default was ONCEFLOW_DATABASE_URL's value,
// password and all (pgx's own errors redact it). The variable still works.
func TestHelpDoesNotPrintTheDatabasePassword(t *testing.T) {
	t.Setenv("ONCEFLOW_DATABASE_URL", "postgres://u:hunter2@db.invalid/x")
	for _, cmd := range [][]string{{"relay"}, {"status"}, {"migrate", "up"}, {"dead", "list"}} {
		out, _ := runCLI(t, append(cmd, "--help")...)
		if strings.Contains(out, "hunter2") {
			t.Errorf("%s --help prints the database password:\n%s", strings.Join(cmd, " "), out)
		}
	}
	schema := pgtest.Schema(t)
	t.Setenv("ONCEFLOW_DATABASE_URL", pgtest.URL(t))
	if out, err := runCLI(t, "status", "--schema", schema); err != nil || !strings.Contains(out, "backlog:") {
		t.Fatalf("status with the URL from ONCEFLOW_DATABASE_URL: %v\n%s", err, out)
	}
}

// TestAnUnparsableDatabaseURLIsNotEchoed: pgx redacts a password in a
// connection string it cannot parse only as far as the first space, so
// "password='se cret" came back as "password=xxxxx cret" in the error
// (helper 86). The error names what is wrong, never the string.
func TestAnUnparsableDatabaseURLIsNotEchoed(t *testing.T) {
	for _, url := range []string{
		"host=db.invalid user=u password='hunter two",
		"postgres://u:hunter two@db.invalid/x",
		"postgres://u:hunter2@db.invalid/x?pool_max_conns=many",
		"postgres://u:hunter2@db.invalid:port/x", // net/url's error quotes the URL
	} {
		for _, cmd := range [][]string{{"status"}, {"relay", "--brokers", "k:9092"}, {"migrate", "up"}, {"dead", "list"}, {"demo"}} {
			out, err := runCLI(t, append(cmd, "--database-url", url)...)
			if !errors.Is(err, errUsage) {
				t.Errorf("%s with %q: err %v, want a usage error", cmd[0], url, err)
			}
			msg := out
			if err != nil {
				msg += err.Error()
			}
			if strings.Contains(msg, "hunter") || strings.Contains(msg, "two") || strings.Contains(msg, "db.invalid") {
				t.Errorf("%s with %q shows the connection string:\n%s", cmd[0], url, msg)
			}
			if err != nil && !strings.Contains(err.Error(), "--database-url: cannot parse it") {
				t.Errorf("%s with %q: %v, want it to say --database-url cannot be parsed", cmd[0], url, err)
			}
		}
	}
}

// TestKafkaSecurityThatDoesNothingOrLittleIsSaid: verification skipped
// beside a CA file or server name is refused (it silently cancelled
// them); --kafka-aws-region without AWS_MSK_IAM is refused (it did
// nothing); skipped verification and PLAIN over plaintext are warned at
// start.
func TestKafkaSecurityThatDoesNothingOrLittleIsSaid(t *testing.T) {
	url := pgtest.URL(t)
	for name, tc := range map[string]struct {
		args []string
		want string
	}{
		"insecure beside a ca file": {[]string{"--kafka-tls-insecure-skip-verify", "--kafka-tls-ca-file", "/etc/ssl/certs/ca-certificates.crt"}, "--kafka-tls-insecure-skip-verify"},
		"aws region without iam":    {[]string{"--kafka-aws-region", "eu-west-1"}, "--kafka-aws-region"},
	} {
		_, err := runCLI(t, append([]string{"relay", "--database-url", url, "--brokers", "a:1"}, tc.args...)...)
		if !errors.Is(err, errUsage) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want a usage error naming %s", name, err, tc.want)
		}
	}
	var logged bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logged, nil))
	warnWeakKafkaSecurity(log, kafkaconn.Config{TLS: &kafkaconn.TLS{InsecureSkipVerify: true}})
	warnWeakKafkaSecurity(log, kafkaconn.Config{SASL: &kafkaconn.SASL{Mechanism: kafkaconn.Plain, Username: "u", Password: "p"}})
	warnWeakKafkaSecurity(log, kafkaconn.Config{TLS: &kafkaconn.TLS{}, SASL: &kafkaconn.SASL{Mechanism: kafkaconn.Plain, Username: "u", Password: "p"}})
	// helper 114: AWS_MSK_IAM without TLS looked like an unreachable
	// broker (MSK serves IAM on TLS only), and the signed token, with its
	// session token, would go in the clear.
	warnWeakKafkaSecurity(log, kafkaconn.Config{SASL: &kafkaconn.SASL{Mechanism: kafkaconn.AWSMSKIAM}})
	warnWeakKafkaSecurity(log, kafkaconn.Config{TLS: &kafkaconn.TLS{}, SASL: &kafkaconn.SASL{Mechanism: kafkaconn.AWSMSKIAM}})
	if n := strings.Count(logged.String(), "level=WARN"); n != 3 || !strings.Contains(logged.String(), "not verified") ||
		!strings.Contains(logged.String(), "in the clear") || !strings.Contains(logged.String(), "AWS_MSK_IAM without TLS") {
		t.Errorf("want three Warn lines (verification off; PLAIN in the clear; AWS_MSK_IAM without TLS), got:\n%s", logged.String())
	}
}

// helper 114: --brokers took its default from ONCEFLOW_BROKERS, so --help
// printed a broker list with credentials in it (a user:password@ prefix
// a managed cluster's copy-paste carries), and a colon-less "token@host"
// came back whole in "is not host:port" before ParseBrokers could refuse it
// without repeating it.
func TestBrokerCredentialsAreNotEchoed(t *testing.T) {
	t.Setenv("ONCEFLOW_BROKERS", "u:hunter2@k:9092")
	out, _ := runCLI(t, "relay", "--help")
	if strings.Contains(out, "hunter2") {
		t.Errorf("relay --help prints the broker credentials:\n%s", out)
	}
	t.Setenv("ONCEFLOW_BROKERS", "")
	out, err := runCLI(t, "relay", "--database-url", "postgres://db.invalid/x", "--brokers", "hunter2@k")
	if !errors.Is(err, errUsage) {
		t.Errorf("--brokers hunter2@k: err %v, want a usage error", err)
	}
	if strings.Contains(out, "hunter2") || err != nil && strings.Contains(err.Error(), "hunter2") {
		t.Errorf("--brokers hunter2@k echoes the credential: %v\n%s", err, out)
	}
}

// helper 114: the password file has one trailing newline ignored, but
// ONCEFLOW_KAFKA_SASL_PASSWORD and ONCEFLOW_KAFKA_SASL_USERNAME were taken
// as they are: a Kubernetes secret made with `echo … | base64` carries the
// newline, and the login failed for good with nothing saying why.
func TestKafkaSASLFromTheEnvironmentIgnoresATrailingNewline(t *testing.T) {
	t.Setenv("ONCEFLOW_KAFKA_SASL_USERNAME", "relay\n")
	t.Setenv("ONCEFLOW_KAFKA_SASL_PASSWORD", "s3cret\r\n")
	var kf kafkaFlags
	fs := flag.NewFlagSet("relay", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	kf.register(fs)
	if err := fs.Parse([]string{"--kafka-sasl-mechanism", "SCRAM-SHA-512"}); err != nil {
		t.Fatal(err)
	}
	_, conn, err := kf.conn([]string{"k:9092"})
	if err != nil {
		t.Fatal(err)
	}
	if conn.SASL.Username != "relay" || conn.SASL.Password != "s3cret" {
		t.Fatalf("user %q, password of %d bytes; want %q and %q", conn.SASL.Username, len(conn.SASL.Password), "relay", "s3cret")
	}
}
