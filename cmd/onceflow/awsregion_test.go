package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/kgoconn"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/internal/tlstest"
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
	const host = "kafka.internal:9098" // a private name: no region in it
	first, err := franzGoIAMFirstMessage(t, host, "--kafka-aws-region", "us-east-2")
	if err != nil {
		t.Fatalf("franz-go's AWS_MSK_IAM with --kafka-aws-region us-east-2: %v", err)
	}
	if !strings.Contains(first, "/us-east-2/kafka-cluster/aws4_request") {
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
	first, err := franzGoIAMFirstMessage(t, "b-1.demo.abc123.c2.kafka.eu-west-1.amazonaws.com:9098")
	if err != nil {
		t.Fatalf("AWS_MSK_IAM with credentials from a profile: %v", err)
	}
	if !strings.Contains(first, `AKIDPROFILE/`) {
		t.Fatalf("signed with other credentials than the profile's: %s", first)
	}
}

// TestMSKIAMWithoutCredentialsIsSaidAtStart: with no credentials anywhere
// every broker connection fails, which the broker check reports without
// the cause; the relay says why once, at start (Error), and runs on (a role
// may be a moment from ready), stopping cleanly.
func TestMSKIAMWithoutCredentialsIsSaidAtStart(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary; skipped with -short")
	}
	bin := buildBinary(t)
	schema := pgtest.Schema(t)
	dir := t.TempDir()
	env := []string{
		"ONCEFLOW_DATABASE_URL=" + pgtest.URL(t), "ONCEFLOW_SCHEMA=" + schema, "ONCEFLOW_LOG_LEVEL=warn",
		"ONCEFLOW_BROKERS=SASL_SSL://b-1.demo.abc123.c2.kafka.eu-west-1.amazonaws.com:9098",
		"ONCEFLOW_KAFKA_SASL_MECHANISM=AWS_MSK_IAM",
		"AWS_SHARED_CREDENTIALS_FILE=" + filepath.Join(dir, "none"), "AWS_CONFIG_FILE=" + filepath.Join(dir, "none"),
		"AWS_EC2_METADATA_DISABLED=true", "HOME=" + dir,
	}
	p := startRelayProc(t, bin, env)
	waitUntil(t, "the relay to say it has no AWS credentials", 30*time.Second, func() bool {
		return p.Printed("level=ERROR") && p.Printed("no AWS credentials for AWS_MSK_IAM yet")
	})
	if _, exited := p.Exited(); exited {
		t.Fatalf("the relay exited:\n%s", p.Output())
	}
	_ = p.Signal(syscall.SIGTERM)
	if err, exited := p.Wait(30 * time.Second); !exited || err != nil {
		t.Fatalf("after SIGTERM: exited %v, err %v\n%s", exited, err, p.Output())
	}
}

// TestMSKIAMWebIdentityTakesTheBrokersRegion: web identity (EKS service
// accounts, self-managed OIDC) assumes its role through regional STS, and
// the SDK knew no region unless AWS_REGION was set, so the chain failed
// with "Missing Region" though the MSK broker names carry it. Here STS is
// a local server behind an HTTPS proxy that answers for
// sts.eu-west-1.amazonaws.com only (a certificate for that name from the
// test's CA), given to the SDK as its HTTP client (Go reads HTTPS_PROXY
// once per process): the region must reach the SDK.
func TestMSKIAMWebIdentityTakesTheBrokersRegion(t *testing.T) {
	pki := tlstest.New(t)
	stsHost := "sts.eu-west-1.amazonaws.com"
	certFile, keyFile := pki.Issue(t, "sts", []string{stsHost}, nil)
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	sts := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		_ = r.ParseForm()
		if r.Form.Get("Action") != "AssumeRoleWithWebIdentity" || r.Form.Get("WebIdentityToken") != "oidc-token" {
			http.Error(w, "unexpected request", http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "text/xml")
		fmt.Fprint(w, `<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><AssumeRoleWithWebIdentityResult>
<Credentials><AccessKeyId>AKIDWEBIDENTITY</AccessKeyId><SecretAccessKey>secret</SecretAccessKey><SessionToken>session</SessionToken><Expiration>2099-01-01T00:00:00Z</Expiration></Credentials>
<AssumedRoleUser><Arn>arn:aws:sts::123456789012:assumed-role/relay/s</Arn><AssumedRoleId>AROA:s</AssumedRoleId></AssumedRoleUser>
</AssumeRoleWithWebIdentityResult><ResponseMetadata><RequestId>1</RequestId></ResponseMetadata></AssumeRoleWithWebIdentityResponse>`)
	})
	var tunnels []string
	var mu sync.Mutex
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		tunnels = append(tunnels, r.Host)
		mu.Unlock()
		if r.Method != http.MethodConnect || r.Host != stsHost+":443" {
			http.Error(w, "no route", http.StatusBadGateway)
			return
		}
		conn, _, err := w.(http.Hijacker).Hijack()
		if err != nil {
			return
		}
		fmt.Fprint(conn, "HTTP/1.1 200 Connection established\r\n\r\n")
		tc := tls.Server(conn, &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12})
		_ = http.Serve(&oneConnListener{conn: tc}, sts)
	}))
	defer proxy.Close()
	dir := t.TempDir()
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte("oidc-token"), 0o600); err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{
		"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SESSION_TOKEN": "", "AWS_PROFILE": "",
		"AWS_SHARED_CREDENTIALS_FILE": filepath.Join(dir, "none"), "AWS_CONFIG_FILE": filepath.Join(dir, "none"),
		"AWS_EC2_METADATA_DISABLED": "true", "AWS_REGION": "", "AWS_DEFAULT_REGION": "",
		"AWS_WEB_IDENTITY_TOKEN_FILE": token, "AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/relay",
		"AWS_ROLE_SESSION_NAME": "relay", "AWS_CA_BUNDLE": "", "AWS_STS_REGIONAL_ENDPOINTS": "regional",
		"ONCEFLOW_KAFKA_AWS_REGION": "",
	} {
		t.Setenv(k, v)
	}
	proxyURL, err := url.Parse(proxy.URL)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := os.ReadFile(pki.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca)
	awsHTTPClient = &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(proxyURL), TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}}}
	t.Cleanup(func() { awsHTTPClient = nil })
	first, err := franzGoIAMFirstMessage(t, "b-1.demo.abc123.c2.kafka.eu-west-1.amazonaws.com:9098")
	mu.Lock()
	defer mu.Unlock()
	if err != nil {
		t.Fatalf("AWS_MSK_IAM with web identity and no AWS_REGION: %v (proxied: %v)", err, tunnels)
	}
	if !strings.Contains(first, "AKIDWEBIDENTITY/") || calls.Load() == 0 {
		t.Fatalf("signed with other credentials than the assumed role's (STS calls %d, proxied %v): %s", calls.Load(), tunnels, first)
	}
}

// oneConnListener serves one connection to http.Serve.
type oneConnListener struct {
	conn net.Conn
	done bool
	mu   sync.Mutex
}

func (l *oneConnListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.done {
		return nil, io.EOF
	}
	l.done = true
	return l.conn, nil
}

func (l *oneConnListener) Close() error   { return nil }
func (l *oneConnListener) Addr() net.Addr { return l.conn.LocalAddr() }

// TestMSKIAMWithABrokenAWSConfigurationRefusesToStart: a profile that does
// not exist (a typo) or a malformed file cannot heal while the relay runs;
// it is refused at start, naming it, rather than left to fail every broker
// connection.
func TestMSKIAMWithABrokenAWSConfigurationRefusesToStart(t *testing.T) {
	dir := t.TempDir()
	config := filepath.Join(dir, "config")
	if err := os.WriteFile(config, []byte("[profile relay]\nregion = eu-west-1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{
		"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_PROFILE": "relya",
		"AWS_SHARED_CREDENTIALS_FILE": filepath.Join(dir, "none"), "AWS_CONFIG_FILE": config,
		"AWS_EC2_METADATA_DISABLED": "true", "ONCEFLOW_KAFKA_AWS_REGION": "",
	} {
		t.Setenv(k, v)
	}
	_, err := runCLI(t, "relay", "--database-url", pgtest.URL(t), "--brokers", "SASL_SSL://b-1.demo.abc123.c2.kafka.eu-west-1.amazonaws.com:9098",
		"--kafka-sasl-mechanism", "AWS_MSK_IAM")
	if !errors.Is(err, errUsage) || !strings.Contains(err.Error(), "relya") {
		t.Fatalf("err = %v, want a usage error naming the missing profile", err)
	}
}

// franzGoIAMFirstMessage parses the relay's Kafka flags for AWS_MSK_IAM
// (plus extra) against host, as the binary does, and returns the first
// message franz-go's mechanism would send it: the signed request.
func franzGoIAMFirstMessage(t *testing.T, host string, extra ...string) (string, error) {
	t.Helper()
	var kf kafkaFlags
	fs := flag.NewFlagSet("relay", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	kf.register(fs)
	if err := fs.Parse(append([]string{"--kafka-sasl-mechanism", "AWS_MSK_IAM"}, extra...)); err != nil {
		t.Fatal(err)
	}
	_, conn, err := kf.conn([]string{"SASL_SSL://" + host})
	if err != nil {
		t.Fatal(err)
	}
	m, err := kgoconn.Mechanism(conn.SASL)
	if err != nil {
		t.Fatal(err)
	}
	_, first, err := m.Authenticate(context.Background(), host)
	return string(first), err
}

// helper 114: AWS_MSK_IAM against a broker name that carries no region
// (a custom DNS name), with neither --kafka-aws-region nor AWS_REGION nor
// AWS_DEFAULT_REGION, started, and then failed every connection ("no
// region") for good: a setting that cannot heal while the relay runs is a
// usage error at start, naming the flag.
func TestMSKIAMWithoutARegionRefusesToStart(t *testing.T) {
	dir := t.TempDir()
	for k, v := range map[string]string{
		"AWS_ACCESS_KEY_ID": "AKIDSTATIC", "AWS_SECRET_ACCESS_KEY": "secret", "AWS_SESSION_TOKEN": "", "AWS_PROFILE": "",
		"AWS_SHARED_CREDENTIALS_FILE": filepath.Join(dir, "none"), "AWS_CONFIG_FILE": filepath.Join(dir, "none"),
		"AWS_EC2_METADATA_DISABLED": "true", "AWS_REGION": "", "AWS_DEFAULT_REGION": "", "ONCEFLOW_KAFKA_AWS_REGION": "",
	} {
		t.Setenv(k, v)
	}
	_, err := runCLI(t, "relay", "--database-url", pgtest.URL(t), "--brokers", "kafka.internal:9098", "--kafka-tls",
		"--kafka-sasl-mechanism", "AWS_MSK_IAM")
	if !errors.Is(err, errUsage) || !strings.Contains(err.Error(), "--kafka-aws-region") {
		t.Fatalf("err = %v, want a usage error naming --kafka-aws-region", err)
	}
}
