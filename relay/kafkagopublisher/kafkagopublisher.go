// Package kafkagopublisher is a relay Publisher on segmentio/kafka-go.
//
// kafka-go has no idempotent producer: when a produce request times out
// after the broker wrote it, the retry writes it again, so expect more
// duplicates than with the default franz-go publisher (consumers deduplicate
// on message-id either way). It is configured as the relay needs, not with
// kafka-go's defaults (acks=none, 1 s batch timeout): acks=all, a 1 ms batch
// timeout, murmur2 key partitioning as the Java client does, and batches
// large enough that one relay round is one request per partition.
package kafkagopublisher

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/onceflow/onceflow/relay"
)

// Config configures a Publisher. A nil *Config means all defaults.
type Config struct {
	// BatchTimeout is how long the writer waits to fill a batch.
	// Defaults to 1ms.
	BatchTimeout time.Duration
	// BatchBytes is the largest request per partition; a record larger than
	// it is refused as too large. Defaults to 1048576 (Kafka's default
	// max.message.bytes).
	BatchBytes int64
	// MaxAttempts bounds kafka-go's own retries of one write; the relay
	// retries after that. Defaults to 5.
	MaxAttempts int
	// Transport carries TLS/SASL settings. Defaults to kafka.DefaultTransport.
	Transport kafka.RoundTripper
}

// Publisher publishes through a kafka.Writer. Publish is called by one
// relay goroutine at a time; Close is idempotent.
type Publisher struct {
	w *kafka.Writer
}

var _ relay.Publisher = (*Publisher)(nil)

// New returns a Publisher for brokers. cfg may be nil.
func New(brokers []string, cfg *Config) (*Publisher, error) {
	if len(brokers) == 0 {
		return nil, errors.New("kafkagopublisher: no brokers given")
	}
	c := Config{}
	if cfg != nil {
		c = *cfg
	}
	if c.BatchTimeout == 0 {
		c.BatchTimeout = time.Millisecond
	}
	if c.BatchBytes == 0 {
		c.BatchBytes = 1 << 20
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 5
	}
	switch {
	case c.BatchTimeout < 0:
		return nil, fmt.Errorf("kafkagopublisher: Config.BatchTimeout must not be negative, got %s", c.BatchTimeout)
	case c.BatchBytes < 1024:
		return nil, fmt.Errorf("kafkagopublisher: Config.BatchBytes must be at least 1024, got %d", c.BatchBytes)
	case c.MaxAttempts < 1:
		return nil, fmt.Errorf("kafkagopublisher: Config.MaxAttempts must be at least 1, got %d", c.MaxAttempts)
	}
	return &Publisher{w: &kafka.Writer{
		Addr:                   kafka.TCP(brokers...),
		Balancer:               &kafka.Murmur2Balancer{},
		RequiredAcks:           kafka.RequireAll,
		BatchTimeout:           c.BatchTimeout,
		BatchSize:              100_000,
		BatchBytes:             c.BatchBytes,
		MaxAttempts:            c.MaxAttempts,
		AllowAutoTopicCreation: false,
		Transport:              c.Transport,
	}}, nil
}

// Publish writes records topic by topic and reports each record's outcome.
// kafka-go fails a whole call for one unknown topic or one oversized
// record, so records are grouped by topic and an oversized record is taken
// out and the rest written again.
func (p *Publisher) Publish(ctx context.Context, records []relay.Record) []error {
	errs := make([]error, len(records))
	byTopic := map[string][]int{}
	var topics []string
	for i, r := range records {
		if _, ok := byTopic[r.Topic]; !ok {
			topics = append(topics, r.Topic)
		}
		byTopic[r.Topic] = append(byTopic[r.Topic], i)
	}
	for _, topic := range topics {
		p.publishTopic(ctx, records, byTopic[topic], errs)
	}
	return errs
}

func (p *Publisher) publishTopic(ctx context.Context, records []relay.Record, idx []int, errs []error) {
	for len(idx) > 0 {
		msgs := make([]kafka.Message, len(idx))
		for j, i := range idx {
			msgs[j] = toMessage(records[i])
		}
		err := p.w.WriteMessages(ctx, msgs...)
		var tooLarge kafka.MessageTooLargeError
		var perMessage kafka.WriteErrors
		switch {
		case err == nil:
			return
		case errors.As(err, &tooLarge):
			// Find the offender (kafka-go returns a copy), fail it, retry the rest.
			j := indexOf(msgs, tooLarge.Message)
			errs[idx[j]] = classify(err)
			idx = append(idx[:j:j], idx[j+1:]...)
		case errors.As(err, &perMessage) && len(perMessage) == len(idx):
			for j, e := range perMessage {
				errs[idx[j]] = classify(e)
			}
			return
		default:
			for _, i := range idx {
				errs[i] = classify(err)
			}
			return
		}
	}
}

func indexOf(msgs []kafka.Message, m kafka.Message) int {
	for j := range msgs {
		if sameMessage(msgs[j], m) {
			return j
		}
	}
	return 0
}

func sameMessage(a, b kafka.Message) bool {
	if string(a.Key) != string(b.Key) || string(a.Value) != string(b.Value) || len(a.Headers) != len(b.Headers) {
		return false
	}
	for i := range a.Headers {
		if a.Headers[i].Key != b.Headers[i].Key || string(a.Headers[i].Value) != string(b.Headers[i].Value) {
			return false
		}
	}
	return true
}

func toMessage(r relay.Record) kafka.Message {
	m := kafka.Message{Topic: r.Topic, Key: r.Key, Value: r.Value}
	if len(r.Headers) > 0 {
		m.Headers = make([]kafka.Header, len(r.Headers))
		for i, h := range r.Headers {
			m.Headers[i] = kafka.Header{Key: h.Key, Value: h.Value}
		}
	}
	return m
}

// Close flushes and closes the writer.
func (p *Publisher) Close() error { return p.w.Close() }

func classify(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, kafka.MessageSizeTooLarge), errors.Is(err, kafka.RecordListTooLarge):
		return fmt.Errorf("%w: %w", relay.ErrRecordTooLarge, err)
	case errors.Is(err, kafka.TopicAuthorizationFailed), errors.Is(err, kafka.InvalidTopic):
		return fmt.Errorf("%w: %w", relay.ErrTopicForbidden, err)
	case errors.Is(err, kafka.UnknownTopicOrPartition), errors.Is(err, kafka.UnknownTopicID):
		return fmt.Errorf("%w: %w", relay.ErrUnknownTopic, err)
	case errors.Is(err, kafka.InvalidRecord): // not InvalidMessage (CORRUPT_MESSAGE): Kafka retries that
		return fmt.Errorf("%w: %w", relay.ErrRecordInvalid, err)
	default:
		return err
	}
}
