package kafkagoconsumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/kafkagoconn"
	"github.com/onceflow/onceflow/kafkaconn"
)

// Config configures a Consumer. Reader.Brokers and the topics are required.
type Config struct {
	// Reader configures the kafka-go Reader. Brokers and GroupTopics (or
	// Topic) are required; GroupID defaults to the Processor's name;
	// Partition must be unset. CommitInterval is ignored: the Consumer
	// commits itself (see CommitInterval below). MaxWait defaults to 500ms
	// rather than kafka-go's 10s. IsolationLevel is ignored by kafka-go's
	// Reader; see the package doc. Other zero fields keep kafka-go's
	// defaults.
	Reader kafka.ReaderConfig
	// Conn is how to reach the brokers: client id, TLS, SASL. It becomes
	// Reader.Dialer and the default dead-letter Writer's transport. Set
	// Conn or Reader.Dialer, not both. Defaults to plaintext without
	// authentication.
	Conn kafkaconn.Config
	// CommitInterval is how often offsets of finished messages are
	// committed; they are also committed at shutdown. Defaults to 1s.
	CommitInterval time.Duration
	// ShutdownGrace is how long a transaction in flight may take to finish
	// at shutdown before it is canceled and rolled back. Defaults to 5s.
	ShutdownGrace time.Duration
	// DeadLetterWriter publishes dead letters; its Topic must be empty (each
	// record names its own). Defaults to a Writer on Reader.Brokers with
	// RequiredAcks all, murmur2 partitioning and a 5ms BatchTimeout
	// (kafka-go's defaults are acks=none and 1s).
	DeadLetterWriter *kafka.Writer
	// StopOnMissingDeadLetterTopic makes Run stop (draining and
	// committing what finished, as at shutdown) and return an error
	// wrapping consumer.ErrDeadLetterTopicMissing when a dead letter
	// cannot be published because its topic does not exist. Otherwise the
	// message's partition waits, retrying, with an Error log and a
	// consumer.HookDeadLetterFailed event per failed publish, until the
	// topic is created. onceflow never creates topics. Defaults to false.
	StopOnMissingDeadLetterTopic bool
	// Logger receives fetch and commit errors (Warn). Defaults to
	// discarding.
	Logger *slog.Logger
}

// Consumer runs a consumer.Processor over a kafka-go Reader in a consumer
// group. It is not safe to call Run more than once.
type Consumer struct {
	p      *consumer.Processor
	cfg    Config
	log    *slog.Logger
	writer *kafka.Writer
	// ownTransport is the default dead-letter Writer's transport, closed
	// at shutdown; nil when the user supplied the Writer.
	ownTransport *kafka.Transport

	mu      sync.Mutex
	stopRun context.CancelFunc
	err     error // why Run stopped on its own
	parts   map[tp]*consumer.Partition
	marks   map[tp]kafka.Message // highest finished message per partition, not yet committed
}

type tp struct {
	topic     string
	partition int
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
	if c.Reader.GroupID == "" {
		c.Reader.GroupID = p.Name()
	}
	c.Reader.CommitInterval = 0 // synchronous CommitMessages, called by our committer
	if c.Reader.MaxWait == 0 {
		c.Reader.MaxWait = 500 * time.Millisecond
	}
	if c.CommitInterval == 0 {
		c.CommitInterval = time.Second
	}
	if c.ShutdownGrace == 0 {
		c.ShutdownGrace = 5 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	switch {
	case len(c.Reader.Brokers) == 0:
		return nil, errors.New("kafkagoconsumer: Config.Reader.Brokers is required")
	case len(c.Reader.GroupTopics) == 0 && c.Reader.Topic == "":
		return nil, errors.New("kafkagoconsumer: Config.Reader.GroupTopics (or Topic) is required")
	case c.Reader.Partition != 0:
		return nil, errors.New("kafkagoconsumer: Config.Reader.Partition must be unset: the Consumer needs a consumer group")
	case c.CommitInterval < 0:
		return nil, errors.New("kafkagoconsumer: Config.CommitInterval must not be negative")
	case c.ShutdownGrace < 0:
		return nil, errors.New("kafkagoconsumer: Config.ShutdownGrace must not be negative")
	case c.DeadLetterWriter != nil && c.DeadLetterWriter.Topic != "":
		return nil, errors.New("kafkagoconsumer: Config.DeadLetterWriter.Topic must be empty")
	}
	if err := kafkaconn.CheckBrokers(c.Reader.Brokers); err != nil {
		return nil, fmt.Errorf("kafkagoconsumer: Config.Reader.Brokers: %w", err)
	}
	if c.Conn != (kafkaconn.Config{}) {
		if c.Reader.Dialer != nil {
			return nil, errors.New("kafkagoconsumer: Config.Conn and Config.Reader.Dialer are both set; set one")
		}
		d, err := kafkagoconn.Dialer(c.Conn)
		if err != nil {
			return nil, fmt.Errorf("kafkagoconsumer: Config.Conn.%w", err)
		}
		c.Reader.Dialer = d
	}
	if err := c.Reader.Validate(); err != nil {
		return nil, fmt.Errorf("kafkagoconsumer: Config.Reader: %w", err)
	}
	out := &Consumer{p: p, cfg: c, log: c.Logger.With("consumer", p.Name(), "group", c.Reader.GroupID),
		parts: map[tp]*consumer.Partition{}, marks: map[tp]kafka.Message{}}
	out.writer = c.DeadLetterWriter
	if out.writer == nil {
		out.ownTransport = &kafka.Transport{}
		if c.Reader.Dialer != nil {
			out.ownTransport.TLS = c.Reader.Dialer.TLS
			out.ownTransport.SASL = c.Reader.Dialer.SASLMechanism
			out.ownTransport.ClientID = c.Reader.Dialer.ClientID
		}
		out.writer = &kafka.Writer{
			Addr:         kafka.TCP(c.Reader.Brokers...),
			RequiredAcks: kafka.RequireAll,
			Balancer:     &kafka.Murmur2Balancer{},
			BatchTimeout: 5 * time.Millisecond,
			Transport:    out.ownTransport,
		}
	}
	return out, nil
}

// Run joins the group and processes messages until ctx is canceled, then
// drains (see Config.ShutdownGrace), commits what finished, closes the
// Reader and returns nil. After the same drain it returns an error when
// Config.StopOnMissingDeadLetterTopic stopped it.
func (c *Consumer) Run(ctx context.Context) error {
	procCtx, cancelProc := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelProc()
	outer := ctx
	ctx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	c.mu.Lock()
	c.stopRun = stopRun
	c.mu.Unlock()
	r := kafka.NewReader(c.cfg.Reader)

	commitDone := make(chan struct{})
	commitCtx, stopCommitter := context.WithCancel(context.WithoutCancel(ctx))
	go func() {
		defer close(commitDone)
		t := time.NewTicker(c.cfg.CommitInterval)
		defer t.Stop()
		for {
			select {
			case <-commitCtx.Done():
				return
			case <-t.C:
				c.commit(commitCtx, r)
			}
		}
	}()

	for {
		m, err := r.FetchMessage(ctx)
		if ctx.Err() != nil {
			break
		}
		if err != nil {
			c.log.Warn("kafkagoconsumer: fetch failed", "error", err)
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		key := tp{m.Topic, m.Partition}
		c.mu.Lock()
		w := c.parts[key]
		if w == nil {
			w = c.p.StartPartition(procCtx, &transport{c: c})
			c.parts[key] = w
		}
		c.mu.Unlock()
		msg := Message(m)
		if IsControlRecord(m) {
			err = w.AddSkip(ctx, msg)
		} else {
			err = w.Add(ctx, msg)
		}
		if err != nil && ctx.Err() != nil {
			break
		}
	}

	// Shutdown: stop every partition (finishing in-flight work within the
	// grace), commit what finished, leave the group.
	c.mu.Lock()
	parts := c.parts
	c.parts = map[tp]*consumer.Partition{}
	c.mu.Unlock()
	graceCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.ShutdownGrace)
	var wg sync.WaitGroup
	for _, w := range parts {
		wg.Add(1)
		go func() { defer wg.Done(); w.Stop(graceCtx) }()
	}
	wg.Wait()
	cancel()
	stopCommitter()
	<-commitDone
	finalCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	c.commit(finalCtx, r)
	cancel()
	if err := r.Close(); err != nil {
		c.log.Warn("kafkagoconsumer: close reader", "error", err)
	}
	if c.ownTransport != nil {
		_ = c.writer.Close()
		c.ownTransport.CloseIdleConnections()
	}
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

// commit commits the highest finished offset of every partition with new
// marks. A failed commit keeps the marks for the next round.
func (c *Consumer) commit(ctx context.Context, r *kafka.Reader) {
	c.mu.Lock()
	if len(c.marks) == 0 {
		c.mu.Unlock()
		return
	}
	msgs := make([]kafka.Message, 0, len(c.marks))
	for _, m := range c.marks {
		msgs = append(msgs, m)
	}
	clear(c.marks)
	c.mu.Unlock()
	if err := r.CommitMessages(ctx, msgs...); err != nil {
		c.log.Warn("kafkagoconsumer: commit failed; will retry", "error", err)
		c.mu.Lock()
		for _, m := range msgs {
			c.markLocked(m)
		}
		c.mu.Unlock()
	}
}

func (c *Consumer) markLocked(m kafka.Message) {
	key := tp{m.Topic, m.Partition}
	if old, ok := c.marks[key]; !ok || m.Offset > old.Offset {
		c.marks[key] = m
	}
}

type transport struct{ c *Consumer }

func (t *transport) MarkDone(msg consumer.Message) {
	m, ok := msg.Raw.(kafka.Message)
	if !ok {
		return
	}
	t.c.mu.Lock()
	t.c.markLocked(m)
	t.c.mu.Unlock()
}

func (t *transport) PublishDeadLetter(ctx context.Context, d consumer.DeadLetter) error {
	m := kafka.Message{Topic: d.Topic, Key: d.Key, Value: d.Value, Headers: make([]kafka.Header, len(d.Headers))}
	for i, h := range d.Headers {
		m.Headers[i] = kafka.Header{Key: h.Key, Value: h.Value}
	}
	err := t.c.writer.WriteMessages(ctx, m)
	switch {
	case err == nil:
		return nil
	case unknownTopic(err):
		err = fmt.Errorf("kafkagoconsumer: publish dead letter to %s: %w: %w", d.Topic, consumer.ErrDeadLetterTopicMissing, err)
		if t.c.cfg.StopOnMissingDeadLetterTopic {
			t.c.fail(err)
		}
		return err
	default:
		return fmt.Errorf("kafkagoconsumer: publish dead letter to %s: %w", d.Topic, err)
	}
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

// IsControlRecord reports whether m looks like a transaction marker (commit
// or abort), which kafka-go's Reader hands to the application as if it were
// a message. kafka-go does not expose the batch's control flag, so this
// checks the marker's shape: no headers, a 4-byte key holding version 0 and
// type 0 (abort) or 1 (commit), and a 6-byte value holding version 0 and
// the coordinator epoch.
func IsControlRecord(m kafka.Message) bool {
	return len(m.Headers) == 0 &&
		len(m.Key) == 4 && m.Key[0] == 0 && m.Key[1] == 0 && m.Key[2] == 0 && m.Key[3] <= 1 &&
		len(m.Value) == 6 && m.Value[0] == 0 && m.Value[1] == 0
}
