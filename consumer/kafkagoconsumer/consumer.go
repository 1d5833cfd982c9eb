package kafkagoconsumer

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/internal/deadletter"
	"github.com/onceflow/onceflow/internal/kafkagoconn"
	"github.com/onceflow/onceflow/kafkaconn"
)

// Config configures a Consumer. Reader.Brokers and the topics are required.
type Config struct {
	// Reader holds the group and fetch settings, named as for a kafka-go
	// Reader; the Consumer does not build a Reader (see the package doc).
	// Brokers and GroupTopics (or Topic) are required; GroupID defaults to
	// the Processor's name; Partition must be unset. Used as kafka-go uses
	// them: Dialer (TLS, SASL, client id: for the group coordinator and
	// for fetches), GroupBalancers, HeartbeatInterval, SessionTimeout,
	// RebalanceTimeout, JoinGroupBackoff, RetentionTime, StartOffset,
	// MinBytes, MaxBytes, MaxWait (defaults to 500ms rather than 10s),
	// ReadBackoffMin/Max (the wait after a failed fetch), IsolationLevel,
	// Logger and ErrorLogger. PartitionWatchInterval is how often the
	// Consumer checks the topics' partition counts (default 5s), which it
	// always does, whatever WatchPartitionChanges says: partitions added
	// to a topic are otherwise never consumed until an unrelated
	// rebalance, and a topic deleted and created again never. A change
	// makes the member rejoin the group. CommitInterval, QueueCapacity and
	// the Reader's other fields are ignored. Other zero fields keep
	// kafka-go's defaults.
	Reader kafka.ReaderConfig
	// Conn is how to reach the brokers: client id, TLS, SASL. It becomes
	// Reader.Dialer (for the group coordinator), the fetches' transport and
	// the default dead-letter Writer's transport. Set Conn or
	// Reader.Dialer, not both. Defaults to plaintext without
	// authentication.
	Conn kafkaconn.Config
	// CommitInterval is how often offsets of finished messages are
	// committed; they are also committed when the generation ends (a
	// rebalance) and at shutdown. Defaults to 1s.
	CommitInterval time.Duration
	// ShutdownGrace is how long a transaction in flight may take to finish
	// at shutdown before its context is canceled and it rolls back.
	// Defaults to 5s.
	ShutdownGrace time.Duration
	// RevokeGrace is how long a transaction in flight may take to finish
	// when the generation ends for a rebalance (a member joins or leaves,
	// this member lost its session) before its context is canceled and it
	// rolls back. Every partition of the member waits for it (kafka-go's
	// rebalances revoke them all), and the member must rejoin within
	// Reader.RebalanceTimeout or be evicted, so it is kept short: a
	// handler stuck on one partition holds the member up for RevokeGrace
	// at most. Defaults to 1s, and never exceeds a quarter of
	// Reader.RebalanceTimeout (kafka-go's default: 30s).
	RevokeGrace time.Duration
	// DeadLetterWriter publishes dead letters; its Topic must be empty (each
	// record names its own), its RequiredAcks kafka.RequireAll and Async
	// false, or New refuses it: a dead letter counts as written when
	// WriteMessages returns. Defaults to a Writer on Reader.Brokers with
	// RequiredAcks all, murmur2 partitioning, a 5ms BatchTimeout
	// (kafka-go's defaults are acks=none and 1s) and a 64 MiB BatchBytes
	// (kafka-go's default, 1 MiB, would refuse a dead letter its topic
	// takes), over Reader.Dialer's TLS and SASL settings. A Writer of
	// your own refuses dead letters over its BatchBytes as too large.
	DeadLetterWriter *kafka.Writer
	// StopOnMissingDeadLetterTopic makes Run stop (draining and
	// committing what finished, as at shutdown) and return an error
	// wrapping consumer.ErrDeadLetterTopicMissing when a dead letter
	// cannot be published because its topic does not exist. Otherwise the
	// message's partition waits, retrying, with an Error log and a
	// consumer.HookDeadLetterFailed event per failed publish, until the
	// topic is created. onceflow never creates topics. Defaults to false.
	StopOnMissingDeadLetterTopic bool
	// Logger receives group, fetch and commit errors (Warn); a
	// partition's fetch failures at most once per 10s, with the count of
	// those left out. Defaults to slog.Default().
	Logger *slog.Logger
}

// Consumer runs a consumer.Processor in a Kafka consumer group over
// segmentio/kafka-go. It is not safe to call Run more than once.
type Consumer struct {
	p     *consumer.Processor
	cfg   Config
	group kafka.ConsumerGroupConfig
	log   *slog.Logger
	// client fetches records and lists offsets over fetchTransport.
	client         *kafka.Client
	fetchTransport *kafka.Transport
	fetchErrs      fetchErrorLog
	writer         *kafka.Writer
	// deadLetters has each dead letter judged alone for its size.
	deadLetters deadletter.Topics
	// prober asks for a dead-letter topic the Writer reports unknown by
	// name (hiddenByACL); nil when the Writer's Transport is not a
	// *kafka.Transport.
	prober *kafkagoconn.Prober
	// ownTransport is the default dead-letter Writer's transport, closed
	// at shutdown; nil when the user supplied the Writer.
	ownTransport *kafka.Transport

	mu      sync.Mutex
	stopRun context.CancelFunc
	err     error // why Run stopped on its own
}

// New returns a Consumer for p.
func New(p *consumer.Processor, cfg *Config) (*Consumer, error) {
	if p == nil {
		return nil, errors.New("kafkagoconsumer: processor is nil")
	}
	if cfg == nil {
		return nil, errors.New("kafkagoconsumer: Config.Reader.Brokers and topics are required")
	}
	c := *cfg
	r := &c.Reader
	if r.GroupID == "" {
		r.GroupID = p.Name()
	}
	if r.MaxWait == 0 {
		r.MaxWait = 500 * time.Millisecond
	}
	if r.MinBytes == 0 {
		r.MinBytes = 1
	}
	if r.MaxBytes == 0 {
		r.MaxBytes = 1e6
	}
	if r.ReadBackoffMin == 0 {
		r.ReadBackoffMin = 100 * time.Millisecond
	}
	if r.ReadBackoffMax == 0 {
		r.ReadBackoffMax = time.Second
	}
	if c.CommitInterval == 0 {
		c.CommitInterval = time.Second
	}
	if c.ShutdownGrace == 0 {
		c.ShutdownGrace = 5 * time.Second
	}
	if c.RevokeGrace == 0 {
		c.RevokeGrace = time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	topics := r.GroupTopics
	if len(topics) == 0 && r.Topic != "" {
		topics = []string{r.Topic}
	}
	switch {
	case len(r.Brokers) == 0:
		return nil, errors.New("kafkagoconsumer: Config.Reader.Brokers is required")
	case len(topics) == 0:
		return nil, errors.New("kafkagoconsumer: Config.Reader.GroupTopics (or Topic) is required")
	case r.Partition != 0:
		return nil, errors.New("kafkagoconsumer: Config.Reader.Partition must be unset: the Consumer needs a consumer group")
	case r.MinBytes < 0 || r.MaxBytes < r.MinBytes:
		return nil, errors.New("kafkagoconsumer: Config.Reader.MinBytes and MaxBytes must satisfy 0 <= MinBytes <= MaxBytes")
	case r.MaxWait < 0 || r.ReadBackoffMin < 0 || r.ReadBackoffMax < r.ReadBackoffMin:
		return nil, errors.New("kafkagoconsumer: Config.Reader.MaxWait, ReadBackoffMin and ReadBackoffMax must not be negative, and ReadBackoffMax not below ReadBackoffMin")
	case c.CommitInterval < 0:
		return nil, errors.New("kafkagoconsumer: Config.CommitInterval must not be negative")
	case c.ShutdownGrace < 0:
		return nil, errors.New("kafkagoconsumer: Config.ShutdownGrace must not be negative")
	case c.RevokeGrace < 0:
		return nil, errors.New("kafkagoconsumer: Config.RevokeGrace must not be negative")
	case c.DeadLetterWriter != nil && c.DeadLetterWriter.Topic != "":
		return nil, errors.New("kafkagoconsumer: Config.DeadLetterWriter.Topic must be empty")
	// A dead letter counts as written, and its message's offset is
	// committed, when WriteMessages returns nil: without acks, or
	// asynchronously, it returns nil for a record the broker refused or
	// has not written; with the leader's ack alone the record is lost if
	// the leader fails before a follower copied it.
	case c.DeadLetterWriter != nil && c.DeadLetterWriter.RequiredAcks != kafka.RequireAll:
		return nil, fmt.Errorf("kafkagoconsumer: Config.DeadLetterWriter.RequiredAcks must be kafka.RequireAll (-1), not %d: without acks a dead letter the broker refuses counts as written, and with the leader's alone it is lost if the leader fails before a follower copied it, while its message's offset is committed", c.DeadLetterWriter.RequiredAcks)
	case c.DeadLetterWriter != nil && c.DeadLetterWriter.Async:
		return nil, errors.New("kafkagoconsumer: Config.DeadLetterWriter.Async must be false: an asynchronous write returns before the dead letter is written, and its message's offset would be committed")
	}
	if err := kafkaconn.CheckBrokers(r.Brokers); err != nil {
		return nil, fmt.Errorf("kafkagoconsumer: Config.Reader.Brokers: %w", err)
	}
	if c.Conn != (kafkaconn.Config{}) {
		if r.Dialer != nil {
			return nil, errors.New("kafkagoconsumer: Config.Conn and Config.Reader.Dialer are both set; set one")
		}
		d, err := kafkagoconn.Dialer(c.Conn)
		if err != nil {
			return nil, fmt.Errorf("kafkagoconsumer: Config.Conn.%w", err)
		}
		r.Dialer = d
	}
	group := kafka.ConsumerGroupConfig{
		ID:                     r.GroupID,
		Brokers:                r.Brokers,
		Dialer:                 r.Dialer,
		Topics:                 topics,
		GroupBalancers:         r.GroupBalancers,
		HeartbeatInterval:      r.HeartbeatInterval,
		PartitionWatchInterval: r.PartitionWatchInterval,
		// Partition changes are watched always, by the Consumer itself
		// (see watchPartitions).
		WatchPartitionChanges: false,
		SessionTimeout:        r.SessionTimeout,
		RebalanceTimeout:      r.RebalanceTimeout,
		JoinGroupBackoff:      r.JoinGroupBackoff,
		RetentionTime:         r.RetentionTime,
		StartOffset:           r.StartOffset,
		Logger:                r.Logger,
		ErrorLogger:           r.ErrorLogger,
	}
	if err := group.Validate(); err != nil {
		return nil, fmt.Errorf("kafkagoconsumer: Config.Reader: %w", err)
	}
	// Validate applied kafka-go's default RebalanceTimeout.
	c.RevokeGrace = min(c.RevokeGrace, group.RebalanceTimeout/4)
	out := &Consumer{p: p, cfg: c, group: group, log: c.Logger.With("consumer", p.Name(), "group", r.GroupID)}
	out.fetchTransport = newTransport(r.Dialer)
	out.client = &kafka.Client{Addr: kafka.TCP(r.Brokers...), Transport: out.fetchTransport}
	out.writer = c.DeadLetterWriter
	if out.writer == nil {
		out.ownTransport = newTransport(r.Dialer)
		out.writer = &kafka.Writer{
			Addr:         kafka.TCP(r.Brokers...),
			RequiredAcks: kafka.RequireAll,
			Balancer:     &kafka.Murmur2Balancer{},
			BatchTimeout: 5 * time.Millisecond,
			// A dead letter is refused for its size by its topic, not by
			// kafka-go's default limit (1 MiB): refused, it would go out
			// without the original's value though its topic takes it.
			BatchBytes: deadletter.MaxBytes,
			Transport:  out.ownTransport,
		}
	}
	rt := out.writer.Transport
	if rt == nil {
		rt = kafka.DefaultTransport // what the Writer uses then
	}
	if like, ok := rt.(*kafka.Transport); ok {
		out.prober = kafkagoconn.NewProber(out.writer.Addr, like)
	}
	return out, nil
}

// newTransport returns a Transport (fetches, offset lookups, the default
// dead-letter writer) that connects as d does for the group: its TLS, SASL
// and client id, and its Resolver, DialFunc, LocalAddr, KeepAlive,
// FallbackDelay and Timeout, dialing the way kafka.Dialer does: the name
// resolved first, then DialFunc or a net.Dialer, then the TLS handshake,
// whose server name (unless set) is the resolved host's, as the Dialer
// verifies it (the Transport's own handshake would verify the name before
// resolution).
func newTransport(d *kafka.Dialer) *kafka.Transport {
	t := &kafka.Transport{}
	if d == nil {
		return t
	}
	t.TLS = d.TLS
	t.SASL = d.SASLMechanism
	t.ClientID = d.ClientID
	t.DialTimeout = d.Timeout
	if d.Resolver == nil && d.DialFunc == nil && d.LocalAddr == nil && d.KeepAlive == 0 && d.FallbackDelay == 0 {
		return t // the Transport's own dialer does the same
	}
	dial := d.DialFunc
	if dial == nil {
		dial = (&net.Dialer{LocalAddr: d.LocalAddr, FallbackDelay: d.FallbackDelay, KeepAlive: d.KeepAlive}).DialContext
	}
	tlsConfig := d.TLS
	t.TLS = nil // the handshake happens in Dial
	t.Dial = func(ctx context.Context, network, address string) (net.Conn, error) {
		if d.Resolver != nil {
			host, port, err := net.SplitHostPort(address)
			if err != nil {
				return nil, err
			}
			addrs, err := d.Resolver.LookupHost(ctx, host)
			if err != nil {
				return nil, fmt.Errorf("resolve %s: %w", host, err)
			}
			if len(addrs) > 0 {
				// As kafka.Dialer: the resolved host, and its port only when
				// the address had none.
				h, p, err := net.SplitHostPort(addrs[0])
				if err != nil {
					h, p = addrs[0], ""
				}
				if port == "" {
					port = p
				}
				address = net.JoinHostPort(h, port)
			}
		}
		conn, err := dial(ctx, network, address)
		if err != nil || tlsConfig == nil {
			return conn, err
		}
		c := tlsConfig
		if c.ServerName == "" {
			c = c.Clone()
			c.ServerName, _, _ = net.SplitHostPort(address)
		}
		tc := tls.Client(conn, c)
		if err := tc.HandshakeContext(ctx); err != nil {
			conn.Close()
			return nil, err
		}
		return tc, nil
	}
	return t
}

// Run joins the group and processes messages until ctx is canceled, then
// drains (see Config.ShutdownGrace), commits what finished, leaves the group
// and returns nil. After the same drain it returns an error when
// Config.StopOnMissingDeadLetterTopic stopped it.
func (c *Consumer) Run(ctx context.Context) error {
	outer := ctx
	ctx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	c.mu.Lock()
	c.stopRun = stopRun
	c.mu.Unlock()
	cg, err := kafka.NewConsumerGroup(c.group)
	if err != nil {
		return fmt.Errorf("kafkagoconsumer: consumer group: %w", err)
	}
	for {
		gen, err := cg.Next(ctx)
		if ctx.Err() != nil {
			break
		}
		if err != nil {
			c.log.Warn("kafkagoconsumer: joining the group failed; retrying", "error", err)
			continue
		}
		c.startGeneration(ctx, gen)
	}
	// Closing the group ends the current generation: its partitions drain
	// within ShutdownGrace and commit (see startGeneration) before the
	// member leaves the group.
	_ = cg.Close()
	if c.ownTransport != nil {
		_ = c.writer.Close()
		c.ownTransport.CloseIdleConnections()
	}
	c.fetchTransport.CloseIdleConnections()
	if outer.Err() != nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// fail stops Run with err, once.
func (c *Consumer) fail(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		c.err = err
		c.log.Error("kafkagoconsumer: stopping", "error", err)
		c.stopRun()
	}
}

// generation is one group generation as this member sees it: the
// partitions it was assigned, and the offsets finished in it and not yet
// committed. Offsets are committed through the generation only, so once
// the group moved on the broker refuses them: a member never commits for a
// partition it no longer owns, and no committed offset moves backwards.
type generation struct {
	c   *Consumer
	gen *kafka.Generation

	mu    sync.Mutex
	marks map[tp]int64 // highest finished offset per partition, not yet committed
	// gone holds partitions whose topic went away in this generation:
	// their offsets are never committed in it, as they could land on a
	// topic created again under the same name (see fetcher.run).
	gone map[tp]bool
}

type tp struct {
	topic     string
	partition int
}

// startGeneration starts fetching and processing the generation's
// partitions, each on its own (a stuck partition holds up only itself),
// and a committer. When the generation ends (a rebalance, lost membership,
// shutdown), every partition stops taking work, work in flight gets
// RevokeGrace to finish (ShutdownGrace once run is done) before its
// context is canceled, and what finished is committed in this generation;
// kafka-go's ConsumerGroup rejoins only after that, so a handler that
// ignores its canceled context is abandoned (see consumer.Partition.Stop)
// rather than waited for.
func (c *Consumer) startGeneration(run context.Context, gen *kafka.Generation) {
	g := &generation{c: c, gen: gen, marks: map[tp]int64{}, gone: map[tp]bool{}}
	procCtx, cancelProc := context.WithCancel(context.Background())
	var parts []*consumer.Partition
	for topic, as := range gen.Assignments {
		for _, a := range as {
			w := c.p.StartPartition(procCtx, &transport{c: c, g: g})
			parts = append(parts, w)
			f := &fetcher{c: c, g: g, w: w, topic: topic, partition: a.ID, offset: a.Offset}
			gen.Start(f.run)
		}
	}
	gen.Start(func(gctx context.Context) { c.watchPartitions(gctx, g) })
	gen.Start(func(gctx context.Context) {
		defer cancelProc()
		t := time.NewTicker(c.cfg.CommitInterval)
		defer t.Stop()
	loop:
		for {
			select {
			case <-gctx.Done():
				break loop
			case <-t.C:
				g.commit(false)
			}
		}
		d := c.cfg.RevokeGrace
		if run.Err() != nil {
			d = c.cfg.ShutdownGrace
		}
		grace, cancel := context.WithTimeout(context.Background(), d)
		var wg sync.WaitGroup
		for _, w := range parts {
			wg.Add(1)
			go func() { defer wg.Done(); w.Stop(grace) }()
		}
		wg.Wait()
		cancel()
		g.commit(true)
	})
}

// watchPartitions returns, ending the generation, when a consumed topic's
// partition count changes: partitions added to a topic are then assigned
// when the group rejoins, a topic created (again) is assigned from its
// start, and the offsets of a deleted one are not committed. A topic
// deleted (its count down to 0, or a fetcher finding it gone) is waited
// for in this generation, not rejoined for: the rejoin's leader would ask
// for the topic's partitions the way kafka-go does, allowing the broker to
// create it again, under the operator's feet and with the broker's default
// partition count. The generation ends once the topic exists again.
//
// It runs in place of kafka-go's watcher (Reader.WatchPartitionChanges),
// which ends the generation at once when a topic is missing, so a group
// consuming a topic not created yet would rejoin in a loop, and which asks
// for metadata allowing the broker to create the topic. A failed lookup is
// retried at the next tick.
func (c *Consumer) watchPartitions(ctx context.Context, g *generation) {
	t := time.NewTicker(c.group.PartitionWatchInterval)
	defer t.Stop()
	var was map[string]int
	for {
		if now, err := c.partitionCounts(ctx); err == nil {
			if was == nil {
				was = now
			}
			for topic, n := range now {
				switch {
				case n == 0 && was[topic] > 0:
					for _, a := range g.gen.Assignments[topic] {
						g.forget(tp{topic, a.ID})
					}
					c.log.Warn("kafkagoconsumer: a consumed topic was deleted; its partitions wait for it to be created again",
						"topic", topic, "partitions", was[topic])
				case n > 0 && (n != was[topic] || g.anyGone(topic)):
					if n < was[topic] {
						// Deleted and created again smaller.
						for _, a := range g.gen.Assignments[topic] {
							g.forget(tp{topic, a.ID})
						}
					}
					c.log.Info("kafkagoconsumer: a consumed topic's partitions changed or it was created again; rejoining the group",
						"topic", topic, "was", was[topic], "now", n)
					return
				}
			}
			was = now
		} else if ctx.Err() == nil {
			c.log.Warn("kafkagoconsumer: looking up the consumed topics' partitions failed; will retry", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// partitionCounts returns each consumed topic's partition count, 0 for a
// topic that does not exist. It asks the brokers afresh, over a transport
// of its own: the fetch transport answers from metadata up to 6s old, and
// a generation that began without a topic deleted a moment before would
// take that topic's stale count for its start and miss its recreation.
func (c *Consumer) partitionCounts(ctx context.Context) (map[string]int, error) {
	tr := newTransport(c.group.Dialer)
	tr.MetadataTopics = c.group.Topics
	defer tr.CloseIdleConnections()
	cl := &kafka.Client{Addr: kafka.TCP(c.group.Brokers...), Transport: tr}
	res, err := cl.Metadata(ctx, &kafka.MetadataRequest{Topics: c.group.Topics})
	if err != nil {
		return nil, err
	}
	counts := make(map[string]int, len(c.group.Topics))
	for _, topic := range c.group.Topics {
		counts[topic] = 0
	}
	for _, t := range res.Topics {
		switch {
		case t.Error == nil:
			counts[t.Name] = len(t.Partitions)
		case errors.Is(t.Error, kafka.UnknownTopicOrPartition):
		default:
			return nil, fmt.Errorf("topic %s: %w", t.Name, t.Error)
		}
	}
	return counts, nil
}

func (g *generation) mark(m kafka.Message) {
	g.mu.Lock()
	defer g.mu.Unlock()
	key := tp{m.Topic, m.Partition}
	if g.gone[key] {
		return
	}
	if old, ok := g.marks[key]; !ok || m.Offset > old {
		g.marks[key] = m.Offset
	}
}

// forget drops a partition's uncommitted offsets and ignores those that
// finish later in this generation.
func (g *generation) forget(key tp) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.gone[key] = true
	delete(g.marks, key)
}

// anyGone reports whether a partition of topic was forgotten in this
// generation.
func (g *generation) anyGone(topic string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	for key := range g.gone {
		if key.topic == topic {
			return true
		}
	}
	return false
}

// commit commits the offsets finished since the last commit. A failed
// commit keeps them for the next round, unless this is the generation's
// last commit or the broker says the generation is over.
func (g *generation) commit(last bool) {
	g.mu.Lock()
	if len(g.marks) == 0 {
		g.mu.Unlock()
		return
	}
	marks := g.marks
	g.marks = map[tp]int64{}
	g.mu.Unlock()
	offsets := map[string]map[int]int64{}
	for k, off := range marks {
		if offsets[k.topic] == nil {
			offsets[k.topic] = map[int]int64{}
		}
		offsets[k.topic][k.partition] = off + 1
	}
	err := g.gen.CommitOffsets(offsets)
	if err == nil {
		return
	}
	if last || errors.Is(err, kafka.IllegalGeneration) || errors.Is(err, kafka.UnknownMemberId) || errors.Is(err, kafka.RebalanceInProgress) {
		g.c.log.Warn("kafkagoconsumer: commit refused or failed as the generation ends; those messages will be delivered again and skipped as duplicates",
			"generation", g.gen.ID, "error", err)
		return
	}
	g.c.log.Warn("kafkagoconsumer: commit failed; will retry", "generation", g.gen.ID, "error", err)
	g.mu.Lock()
	for k, off := range marks {
		if old, ok := g.marks[k]; !ok || off > old {
			g.marks[k] = off
		}
	}
	g.mu.Unlock()
}

// transport marks into a generation and dead-letters through the Writer.
type transport struct {
	c *Consumer
	g *generation
}

func (t *transport) MarkDone(msg consumer.Message) {
	if m, ok := msg.Raw.(kafka.Message); ok {
		t.g.mark(m)
	}
}

func (t *transport) PublishDeadLetter(ctx context.Context, d consumer.DeadLetter) error {
	m := kafka.Message{Topic: d.Topic, Key: d.Key, Value: d.Value, Headers: make([]kafka.Header, len(d.Headers))}
	for i, h := range d.Headers {
		m.Headers[i] = kafka.Header{Key: h.Key, Value: h.Value}
	}
	// Refused as too large, it is tried again alone in its batch before
	// it loses its value (deadletter.Topics).
	err := t.c.deadLetters.Publish(ctx, d.Topic, func(ctx context.Context) error {
		return t.c.writer.WriteMessages(ctx, m)
	}, tooLarge)
	switch {
	case err == nil:
		return nil
	case unknownTopic(err) && t.c.hiddenByACL(ctx, d.Topic):
		return fmt.Errorf("kafkagoconsumer: publish dead letter to %s: %w (absent from the topics this principal may list; asked by name)",
			d.Topic, kafka.TopicAuthorizationFailed)
	case unknownTopic(err):
		err = fmt.Errorf("kafkagoconsumer: publish dead letter to %s: %w: %w", d.Topic, consumer.ErrDeadLetterTopicMissing, err)
		if t.c.cfg.StopOnMissingDeadLetterTopic {
			t.c.fail(err)
		}
		return err
	case tooLarge(err):
		return fmt.Errorf("kafkagoconsumer: publish dead letter to %s: %w: %w", d.Topic, consumer.ErrDeadLetterTooLarge, err)
	default:
		return fmt.Errorf("kafkagoconsumer: publish dead letter to %s: %w", d.Topic, err)
	}
}

// hiddenByACL asks the dead-letter Writer's brokers about topic by name
// and reports whether they say this principal may not describe it. The
// Writer knows topics from its transport's list of every topic, from which
// Kafka leaves out a topic an ACL hides, so such a topic reads as unknown
// there: not missing, and StopOnMissingDeadLetterTopic must not stop Run
// for it. The topic's answer is kept a few seconds and stands while the
// brokers cannot be asked again (kafkagoconn.Prober). False with no answer
// yet, or when the Writer's Transport is not a *kafka.Transport (nothing
// to connect as).
func (c *Consumer) hiddenByACL(ctx context.Context, topic string) bool {
	return c.prober != nil && c.prober.Forbidden(ctx, []string{topic})[topic]
}

// unknownTopic reports whether a Writer's error says the topic does not
// exist; kafka.WriteErrors does not unwrap.
func unknownTopic(err error) bool {
	if errors.Is(err, kafka.UnknownTopicOrPartition) {
		return true
	}
	var we kafka.WriteErrors
	if errors.As(err, &we) {
		for _, e := range we {
			if e != nil && errors.Is(e, kafka.UnknownTopicOrPartition) {
				return true
			}
		}
	}
	return false
}

// tooLarge reports whether err refuses a message for its size: the
// writer's own limit (BatchBytes) or the broker's.
func tooLarge(err error) bool {
	var client kafka.MessageTooLargeError
	if errors.As(err, &client) {
		return true
	}
	is := func(e error) bool {
		return errors.Is(e, kafka.MessageSizeTooLarge) || errors.Is(e, kafka.RecordListTooLarge)
	}
	if is(err) {
		return true
	}
	var we kafka.WriteErrors
	if errors.As(err, &we) {
		for _, e := range we {
			if e != nil && is(e) {
				return true
			}
		}
	}
	return false
}

// Message converts a kafka-go message; Raw holds m.
func Message(m kafka.Message) consumer.Message {
	out := consumer.Message{
		Topic:     m.Topic,
		Partition: int32(m.Partition),
		Offset:    m.Offset,
		Key:       m.Key,
		Value:     m.Value,
		Timestamp: m.Time,
		Raw:       m,
	}
	if len(m.Headers) > 0 {
		out.Headers = make([]consumer.Header, len(m.Headers))
		for i, h := range m.Headers {
			out.Headers[i] = consumer.Header{Key: h.Key, Value: h.Value}
		}
	}
	return out
}
