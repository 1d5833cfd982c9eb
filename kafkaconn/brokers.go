package kafkaconn

import (
	"fmt"
	"net"
	"strings"
)

// Protocol is a Kafka listener's security protocol, as the Java client's
// security.protocol spells it.
type Protocol string

// The four security protocols of a Kafka listener.
const (
	Plaintext     Protocol = "PLAINTEXT"
	SSL           Protocol = "SSL"
	SASLPlaintext Protocol = "SASL_PLAINTEXT"
	SASLSSL       Protocol = "SASL_SSL"
)

// TLS reports whether the protocol encrypts.
func (p Protocol) TLS() bool { return p == SSL || p == SASLSSL }

// SASL reports whether the protocol authenticates with SASL.
func (p Protocol) SASL() bool { return p == SASLPlaintext || p == SASLSSL }

// ParseBrokers splits listener prefixes off broker addresses:
// "SASL_SSL://b-1:9096" is host:port "b-1:9096" and protocol SASL_SSL.
// Every address must name the same protocol or none; proto is "" when none
// does. An address that is not host:port, or has an unknown prefix, is an
// error naming it.
func ParseBrokers(addrs []string) (hosts []string, proto Protocol, err error) {
	for i, a := range addrs {
		a = strings.TrimSpace(a)
		if at := strings.LastIndex(a, "@"); at >= 0 {
			// user:password@host:port, as in some URLs: refused, and the
			// credentials not repeated in the error (which gets logged).
			return nil, "", fmt.Errorf("broker %q: credentials do not go in a broker address; use SASL settings", "…@"+a[at+1:])
		}
		var p Protocol
		if scheme, rest, ok := strings.Cut(a, "://"); ok {
			switch Protocol(strings.ToUpper(scheme)) {
			case Plaintext, SSL, SASLPlaintext, SASLSSL:
				p = Protocol(strings.ToUpper(scheme))
			default:
				return nil, "", fmt.Errorf("broker %q: unknown listener prefix %q (want PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL)", a, scheme)
			}
			a = strings.TrimSuffix(rest, "/")
		}
		if i > 0 && p != proto {
			return nil, "", fmt.Errorf("broker %q: every broker must use the same listener prefix (%q and %q given)", addrs[i], proto, p)
		}
		proto = p
		if host, port, err := net.SplitHostPort(a); err != nil || host == "" || port == "" {
			return nil, "", fmt.Errorf("broker %q is not host:port", addrs[i])
		}
		hosts = append(hosts, a)
	}
	return hosts, proto, nil
}

// CheckBrokers returns an error when an address carries a listener prefix
// (SASL_SSL://…): the clients would try to resolve it as a host name and
// fail silently, retrying forever. Adapters call it on their Brokers.
func CheckBrokers(addrs []string) error {
	for _, a := range addrs {
		if strings.Contains(a, "://") {
			return fmt.Errorf("broker %q has a listener prefix; give host:port and set Conn.TLS / Conn.SASL for the security protocol (kafkaconn.ParseBrokers splits it off)", a)
		}
	}
	return nil
}
