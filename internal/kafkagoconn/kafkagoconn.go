// Package kafkagoconn turns a kafkaconn.Config into segmentio/kafka-go
// settings.
package kafkagoconn

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	signer "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/aws_msk_iam_v2"
	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/segmentio/kafka-go/sasl/scram"

	"github.com/onceflow/onceflow/kafkaconn"
)

// Settings validates c and returns its TLS configuration and SASL
// mechanism (each nil when unset).
func Settings(c kafkaconn.Config) (*tls.Config, sasl.Mechanism, error) {
	if err := c.Validate(); err != nil {
		return nil, nil, err
	}
	tc, err := c.TLSConfig()
	if err != nil {
		return nil, nil, err
	}
	if c.SASL == nil {
		return tc, nil, nil
	}
	m, err := Mechanism(c.SASL)
	if err != nil {
		return nil, nil, err
	}
	return tc, m, nil
}

// Transport returns a Transport for c (writers, the dead-letter writer).
func Transport(c kafkaconn.Config) (*kafka.Transport, error) {
	tc, m, err := Settings(c)
	if err != nil {
		return nil, err
	}
	return &kafka.Transport{TLS: tc, SASL: m, ClientID: c.ClientID}, nil
}

// Dialer returns a Dialer for c (readers), with kafka-go's default timeout.
func Dialer(c kafkaconn.Config) (*kafka.Dialer, error) {
	tc, m, err := Settings(c)
	if err != nil {
		return nil, err
	}
	return &kafka.Dialer{Timeout: 10 * time.Second, DualStack: true, TLS: tc, SASLMechanism: m, ClientID: c.ClientID}, nil
}

// TopicErrors asks the brokers at addr about topics by name, never
// creating one, connecting as like does (its dialer, TLS, SASL, client id,
// resolver; kafka-go's defaults when like is nil). It returns each topic's
// error as the broker answered it: nil for a topic that exists,
// kafka.TopicAuthorizationFailed for one the principal may not describe,
// kafka.UnknownTopicOrPartition for one that does not exist.
//
// kafka-go's Transport answers every metadata request that does not ask to
// create topics from its own list of all topics, and Kafka leaves out of
// that list the topics the principal may not describe: through it, a topic
// an ACL hides reads as unknown. A Transport whose MetadataTopics names the
// topics asks for them by name instead, without auto-creation.
//
// Each call dials connections of its own and closes every one of them
// before it returns: kafka-go bounds a connection's dial, TLS and version
// exchange by DialTimeout but not its SASL exchange, so a connection whose
// login stalls would outlive the call. For error paths: see Prober.
func TopicErrors(ctx context.Context, addr net.Addr, like *kafka.Transport, topics []string) (map[string]error, error) {
	dial := defaultDial
	probe := &kafka.Transport{MetadataTopics: topics}
	if like != nil {
		if like.Dial != nil {
			dial = like.Dial
		}
		probe.DialTimeout, probe.IdleTimeout = like.DialTimeout, like.IdleTimeout
		probe.ClientID, probe.TLS, probe.SASL = like.ClientID, like.TLS, like.SASL
		probe.Resolver, probe.Context = like.Resolver, like.Context
	}
	conns := &connSet{}
	probe.Dial = func(ctx context.Context, network, address string) (net.Conn, error) {
		c, err := dial(ctx, network, address)
		if err != nil {
			return nil, err
		}
		return conns.add(c), nil
	}
	defer conns.closeAll()
	defer probe.CloseIdleConnections()
	cl := &kafka.Client{Addr: addr, Transport: probe}
	resp, err := cl.Metadata(ctx, &kafka.MetadataRequest{Addr: addr, Topics: topics})
	if err != nil {
		return nil, err
	}
	out := make(map[string]error, len(topics))
	for _, t := range resp.Topics {
		out[t.Name] = t.Error
	}
	for _, t := range topics {
		if _, ok := out[t]; !ok {
			return nil, fmt.Errorf("metadata by name: topic %q missing from the answer", t)
		}
	}
	return out, nil
}

// defaultDial is how kafka-go's Transport dials without a Dial of its own.
var defaultDial = (&net.Dialer{Timeout: 3 * time.Second}).DialContext

// connSet holds the connections a probe dialed, to close them all when it
// ends; one dialed after that is closed at once.
type connSet struct {
	mu     sync.Mutex
	conns  []net.Conn
	closed bool
}

func (s *connSet) add(c net.Conn) net.Conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		c.Close()
		return c // its use fails: the probe has returned
	}
	s.conns = append(s.conns, c)
	return c
}

func (s *connSet) closeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	for _, c := range s.conns {
		c.Close()
	}
	s.conns = nil
}

// Prober tells, for topics whose writes failed as unknown, which ones the
// brokers say this principal may not describe (TopicErrors), for a writer
// whose Transport knows topics only from its list of every topic. A topic
// keeps its answer for ProbeFresh; one probe runs at a time, for every
// topic whose answer is older, bounded by ProbeTimeout (and the caller's
// ctx); when a probe cannot run or fails, the last answer stands. So a
// topic not created yet costs one probe connection per ProbeFresh, not one
// per failed write, and a hidden topic's answer does not depend on what
// else the caller's ctx had to wait for. Safe for concurrent use.
type Prober struct {
	addr net.Addr
	like *kafka.Transport
	sem  chan struct{} // one probe at a time

	mu      sync.Mutex
	answers map[string]probeAnswer
}

type probeAnswer struct {
	forbidden bool
	at        time.Time
}

const (
	// ProbeFresh is how long a topic's answer is used without asking
	// again: an ACL granted (or a topic created) is seen within it.
	ProbeFresh = 5 * time.Second
	// ProbeTimeout bounds one probe, whatever the caller's ctx.
	ProbeTimeout = 5 * time.Second
)

// NewProber returns a Prober for the brokers at addr, connecting as like
// does (nil: kafka-go's defaults).
func NewProber(addr net.Addr, like *kafka.Transport) *Prober {
	return &Prober{addr: addr, like: like, sem: make(chan struct{}, 1), answers: map[string]probeAnswer{}}
}

// Forbidden returns the topics, of those given, that the brokers last said
// this principal may not describe.
func (p *Prober) Forbidden(ctx context.Context, topics []string) map[string]bool {
	if stale := p.stale(topics); len(stale) > 0 {
		select {
		case p.sem <- struct{}{}:
			if stale = p.stale(stale); len(stale) > 0 { // another call may have asked meanwhile
				p.ask(ctx, stale)
			}
			<-p.sem
		case <-ctx.Done():
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[string]bool{}
	for _, t := range topics {
		if p.answers[t].forbidden {
			out[t] = true
		}
	}
	return out
}

// stale returns the topics whose answer is older than ProbeFresh.
func (p *Prober) stale(topics []string) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	now := time.Now()
	for _, t := range topics {
		if a, ok := p.answers[t]; !ok || now.Sub(a.at) >= ProbeFresh {
			if !slices.Contains(out, t) {
				out = append(out, t)
			}
		}
	}
	return out
}

// ask probes topics and records the answers. A probe that fails (the
// brokers' logins stall, say) stamps the topics' last answers (none:
// not forbidden) as fresh all the same: the next probe waits ProbeFresh,
// rather than every call dialing again and waiting out ProbeTimeout.
func (p *Prober) ask(ctx context.Context, topics []string) {
	ctx, cancel := context.WithTimeout(ctx, ProbeTimeout)
	defer cancel()
	answers, err := TopicErrors(ctx, p.addr, p.like, topics)
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	for t, a := range p.answers {
		if now.Sub(a.at) > probeForget {
			delete(p.answers, t) // a topic not failing any more
		}
	}
	for _, t := range topics {
		a := p.answers[t]
		if err == nil {
			a.forbidden = errors.Is(answers[t], kafka.TopicAuthorizationFailed)
		}
		a.at = now
		p.answers[t] = a
	}
}

// probeForget is how long an answer is kept without being asked for: the
// topics come from outbox rows, and a name that stopped failing must not
// stay in memory for good.
const probeForget = 10 * time.Minute

// Mechanism returns kafka-go's mechanism for s.
func Mechanism(s *kafkaconn.SASL) (sasl.Mechanism, error) {
	switch s.Mechanism {
	case kafkaconn.Plain, kafkaconn.ScramSHA256, kafkaconn.ScramSHA512:
		if s.PasswordFile != "" {
			return passwordFileMechanism{s: s}, nil
		}
		return passwordMechanism(s.Mechanism, s.Username, s.Password)
	case kafkaconn.AWSMSKIAM:
		return &iam{s: s}, nil
	default:
		return nil, fmt.Errorf("SASL.Mechanism: %q is not supported", s.Mechanism)
	}
}

func passwordMechanism(m kafkaconn.Mechanism, user, password string) (sasl.Mechanism, error) {
	switch m {
	case kafkaconn.Plain:
		return plain.Mechanism{Username: user, Password: password}, nil
	case kafkaconn.ScramSHA256:
		return scram.Mechanism(scram.SHA256, user, password)
	default:
		return scram.Mechanism(scram.SHA512, user, password)
	}
}

// passwordFileMechanism reads SASL.PasswordFile for every connection, so a
// secret rotated in place is used on the next one.
type passwordFileMechanism struct{ s *kafkaconn.SASL }

func (m passwordFileMechanism) Name() string { return string(m.s.Mechanism) }

func (m passwordFileMechanism) Start(ctx context.Context) (sasl.StateMachine, []byte, error) {
	pw, err := m.s.CurrentPassword()
	if err != nil {
		return nil, nil, err
	}
	inner, err := passwordMechanism(m.s.Mechanism, m.s.Username, pw)
	if err != nil {
		return nil, nil, err
	}
	return inner.Start(ctx)
}

// iam is aws_msk_iam_v2's mechanism with the region chosen per broker
// (from its MSK host name) as franz-go does, and kafkaconn's credentials.
type iam struct{ s *kafkaconn.SASL }

func (m *iam) Name() string { return string(kafkaconn.AWSMSKIAM) }

func (m *iam) Start(ctx context.Context) (sasl.StateMachine, []byte, error) {
	mech, err := m.mechanism(ctx)
	if err != nil {
		return nil, nil, err
	}
	return mech.Start(ctx)
}

// IAMMechanism builds the aws_msk_iam_v2 mechanism used to dial the broker
// named in ctx's SASL metadata (exported to the package's tests).
func (m *iam) mechanism(ctx context.Context) (*aws_msk_iam_v2.Mechanism, error) {
	host := ""
	if md := sasl.MetadataFromContext(ctx); md != nil {
		host = md.Host
	}
	region, err := m.s.AWSRegionFor(host)
	if err != nil {
		return nil, err
	}
	creds := m.s.AWSCredentials
	if creds == nil {
		creds = kafkaconn.EnvAWSCredentials
	}
	return &aws_msk_iam_v2.Mechanism{
		Signer: signer.NewSigner(),
		Region: region,
		Credentials: aws.CredentialsProviderFunc(func(ctx context.Context) (aws.Credentials, error) {
			c, err := creds(ctx)
			if err != nil {
				return aws.Credentials{}, err
			}
			return aws.Credentials{AccessKeyID: c.AccessKeyID, SecretAccessKey: c.SecretAccessKey, SessionToken: c.SessionToken, Source: "onceflow"}, nil
		}),
	}, nil
}
