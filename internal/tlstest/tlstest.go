// Package tlstest makes a throwaway certificate authority, a server
// certificate for the loopback address and a client certificate, written as
// PEM files into a test's temporary directory.
package tlstest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// PKI is a CA and the certificates it signed, as files.
type PKI struct {
	CAFile                string
	ServerCert, ServerKey string
	ClientCert, ClientKey string
	caPool                *x509.CertPool
	serverPair            tls.Certificate
	dir                   string
	caCert                *x509.Certificate
	caKey                 *ecdsa.PrivateKey
}

// New makes a CA, a server certificate for localhost and 127.0.0.1, and a
// client certificate with common name "client".
func New(t testing.TB) *PKI {
	t.Helper()
	p := &PKI{dir: t.TempDir()}
	caKey := key(t)
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "onceflow test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	p.caCert, _ = x509.ParseCertificate(der)
	p.caKey = caKey
	p.CAFile = p.write(t, "ca.pem", "CERTIFICATE", der)
	p.caPool = x509.NewCertPool()
	p.caPool.AddCert(p.caCert)

	p.ServerCert, p.ServerKey = p.Issue(t, "server", []string{"localhost"}, []net.IP{net.ParseIP("127.0.0.1"), net.IPv6loopback})
	p.ClientCert, p.ClientKey = p.Issue(t, "client", nil, nil)
	p.serverPair, err = tls.LoadX509KeyPair(p.ServerCert, p.ServerKey)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// Issue signs a certificate for names and ips (a client certificate when
// both are empty) and returns its certificate and key files.
func (p *PKI) Issue(t testing.TB, name string, dns []string, ips []net.IP) (certFile, keyFile string) {
	t.Helper()
	k := key(t)
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		DNSNames:     dns,
		IPAddresses:  ips,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.caCert, &k.PublicKey, p.caKey)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	return p.write(t, name+".pem", "CERTIFICATE", der), p.write(t, name+"-key.pem", "EC PRIVATE KEY", kder)
}

// ServerConfig is a listener's TLS configuration; with clientAuth, clients
// must present a certificate signed by the CA.
func (p *PKI) ServerConfig(clientAuth bool) *tls.Config {
	c := &tls.Config{Certificates: []tls.Certificate{p.serverPair}, MinVersion: tls.VersionTLS12}
	if clientAuth {
		c.ClientAuth = tls.RequireAndVerifyClientCert
		c.ClientCAs = p.caPool
	}
	return c
}

func key(t testing.TB) *ecdsa.PrivateKey {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func (p *PKI) write(t testing.TB, name, typ string, der []byte) string {
	path := filepath.Join(p.dir, name)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
