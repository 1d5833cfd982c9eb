package kafkaconn

import (
	"errors"
	"fmt"
	"net"
	"strconv"
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
		if err := checkHostPort(a); err != nil {
			return nil, "", fmt.Errorf("broker %q %w", addrs[i], err)
		}
		hosts = append(hosts, a)
	}
	return hosts, proto, nil
}

// CheckBrokers returns an error when an address carries a listener prefix
// (SASL_SSL://…) or a port that is not a number from 1 to 65535: the
// clients would retry it forever, as if the brokers were down. (A host
// without a port, or a port without a host, is left to the client:
// franz-go takes 9092, and both dial the local host.) Adapters call it on
// their Brokers.
func CheckBrokers(addrs []string) error {
	for _, a := range addrs {
		if strings.Contains(a, "://") {
			return fmt.Errorf("broker %q has a listener prefix; give host:port and set Conn.TLS / Conn.SASL for the security protocol (kafkaconn.ParseBrokers splits it off)", a)
		}
		_, port, err := net.SplitHostPort(a)
		if err != nil {
			continue
		}
		if err := checkPort(port); err != nil {
			return fmt.Errorf("broker %q %w", a, err)
		}
	}
	return nil
}

// checkHostPort reports what is wrong with an address that is not
// host:port with a port from 1 to 65535 (its error reads after the
// address).
func checkHostPort(a string) error {
	host, port, err := net.SplitHostPort(a)
	if err != nil || host == "" || port == "" {
		return errors.New("is not host:port")
	}
	return checkPort(port)
}

// checkPort reports a port that is not a number from 1 to 65535.
func checkPort(port string) error {
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 {
		return fmt.Errorf("has port %q, not a number from 1 to 65535", port)
	}
	return nil
}
