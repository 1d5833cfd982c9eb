// Package kafkagopublisher is a relay Publisher on segmentio/kafka-go.
//
// kafka-go has no idempotent producer: when a produce request times out
// after the broker wrote it, the retry writes it again, so expect more
// duplicates than with the default franz-go publisher (consumers deduplicate
// on message-id either way). It is configured as the relay needs, not with
// kafka-go's defaults (acks=none, 1 s batch timeout): acks=all, a 1 ms batch
// timeout, murmur2 key partitioning as the Java client does, and batches
// large enough that one Publish call is one request per partition.
package kafkagopublisher

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/onceflow/onceflow/internal/kafkagoconn"
	"github.com/onceflow/onceflow/kafkaconn"
	"github.com/onceflow/onceflow/relay"
)

// Config configures a Publisher. A nil *Config means all defaults.
type Config struct {
	// Conn is how to reach the brokers: client id, TLS, SASL. Defaults to
	// plaintext without authentication. Set Conn or Transport, not both.
	Conn kafkaconn.Config
	// BatchTimeout is how long the writer waits to fill a batch (the
	// linger). Defaults to 1ms.
	BatchTimeout time.Duration
	// BatchBytes is the largest request per partition, so the largest
	// record the client accepts: a larger record is refused before it is
	// sent (relay.ErrRecordTooLarge, dead-lettered). Keep it at or below
	// the topic's max.message.bytes. Defaults to 1048576.
	BatchBytes int64
	// Compression is the codec of produced batches: none, gzip, snappy,
	// lz4 or zstd. Defaults to none (kafka-go's default).
	Compression string
	// MaxAttempts bounds kafka-go's own retries of one write; the relay
	// retries after that. Defaults to 5.
	MaxAttempts int
	// Transport is a kafka-go transport of your own, for settings Conn does
	// not cover. Defaults to one built from Conn. A topic that fails as
	// unknown is asked about by name on a connection of its own, made as
	// this transport makes them (at most one such probe per topic every
	// few seconds), so that a topic an ACL hides is reported forbidden,
	// not unknown; with a RoundTripper that is not a *kafka.Transport
	// there is no such probe and it stays unknown.
	Transport kafka.RoundTripper
}

// Publisher publishes through kafka.Writers. Publish is safe for
// concurrent use; Close is idempotent.
//
// A kafka.Writer appends a call's messages to the batch already open for a
// partition, so two concurrent calls on one Writer can split a key's wave
// across two requests, the later landing after the earlier failed (G3). So
// each Publish call checks a Writer out of a free list for its whole run
// (creating one when none is free) and puts it back after: no two calls
// share a Writer. All Writers share one transport (its connections).
type Publisher struct {
	addr      net.Addr
	transport kafka.RoundTripper
	newWriter func() *kafka.Writer // a Writer configured as New says
	// own is the transport New built from Config.Conn, closed by Close;
	// nil when the caller supplied Config.Transport.
	own *kafka.Transport
	// prober asks for topics that failed as unknown by name (see
	// explainUnknown), connecting as transport does; nil when transport
	// is not a *kafka.Transport.
	prober     *kafkagoconn.Prober
	batchBytes int64

	mu     sync.Mutex
	free   []*kafka.Writer
	all    []*kafka.Writer
	closed bool

	// partitions holds each topic's partition count, for Partition: looked
	// up by Publish, beside its writes (one look at a time, ended by
	// Close), for a topic not looked up in the last metadataMaxAge.
	partitions sync.Map // topic → topicMeta
	looking    sync.WaitGroup
	lookingNow atomic.Bool
	lookCtx    context.Context
	stopLooks  context.CancelFunc
}

// topicMeta is what a metadata request said of a topic.
type topicMeta struct {
	ids []int // the partitions, 0..n-1, as the Writer passes them to its balancer
	at  time.Time
}

// metadataMaxAge is how long a topic's partition count is trusted before it
// is looked up again (partitions added): a stale count makes Partition
// wrong for that long, which costs the relay time, never order.
const metadataMaxAge = time.Minute

var (
	_ relay.Publisher         = (*Publisher)(nil)
	_ relay.PartitionReporter = (*Publisher)(nil)
)

// Partition implements relay.PartitionReporter: the partition
// kafka.Murmur2Balancer gives a record with key, among the topic's
// partitions as last looked up by Publish. ok is false for a topic not
// published to yet and for a record without a key (placed at random).
// Safe for concurrent use.
func (p *Publisher) Partition(topic string, key []byte) (int32, bool) {
	v, ok := p.partitions.Load(topic)
	if !ok || key == nil {
		return 0, false
	}
	ids := v.(topicMeta).ids
	if len(ids) == 0 {
		return 0, false
	}
	// The Writer's own balancer, over partitions 0..n-1 as it passes them.
	return int32(kafka.Murmur2Balancer{}.Balance(kafka.Message{Key: key}, ids...)), true
}

// lookUp looks up the partition counts of topics not looked up in the last
// metadataMaxAge: at once (bounded by ctx) if one was never looked up, else
// beside the caller, unless a look is under way. A failed look is tried
// again after metadataMaxAge for a topic looked up before, with the next
// call for one never looked up.
func (p *Publisher) lookUp(ctx context.Context, topics []string) {
	var ask []string
	now := time.Now()
	never := false
	for _, t := range topics {
		v, ok := p.partitions.Load(t)
		if !ok || now.Sub(v.(topicMeta).at) > metadataMaxAge {
			ask = append(ask, t)
			never = never || !ok
		}
	}
	if len(ask) == 0 {
		return
	}
	if never {
		p.metadata(ctx, ask, now)
		return
	}
	if !p.lookingNow.CompareAndSwap(false, true) {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		p.lookingNow.Store(false)
		return
	}
	for _, t := range ask {
		if v, ok := p.partitions.Load(t); ok {
			m := v.(topicMeta)
			m.at = now
			p.partitions.Store(t, m)
		}
	}
	p.looking.Add(1)
	go func() {
		defer p.looking.Done()
		defer p.lookingNow.Store(false)
		ctx, cancel := context.WithTimeout(p.lookCtx, 10*time.Second)
		defer cancel()
		p.metadata(ctx, ask, now)
	}()
}

// metadata asks the cluster for topics' partition counts and records them.
func (p *Publisher) metadata(ctx context.Context, topics []string, now time.Time) {
	cl := &kafka.Client{Addr: p.addr, Transport: p.transport}
	resp, err := cl.Metadata(ctx, &kafka.MetadataRequest{Addr: p.addr, Topics: topics})
	if err != nil {
		return
	}
	for _, t := range resp.Topics {
		if t.Error == nil && len(t.Partitions) > 0 {
			ids := make([]int, len(t.Partitions))
			for i := range ids {
				ids[i] = i
			}
			p.partitions.Store(t.Name, topicMeta{ids: ids, at: now})
		}
	}
}

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
	if err := kafkaconn.CheckBrokers(brokers); err != nil {
		return nil, fmt.Errorf("kafkagopublisher: %w", err)
	}
	var codec kafka.Compression
	switch c.Compression {
	case "", "none":
	case "gzip":
		codec = kafka.Gzip
	case "snappy":
		codec = kafka.Snappy
	case "lz4":
		codec = kafka.Lz4
	case "zstd":
		codec = kafka.Zstd
	default:
		return nil, fmt.Errorf("kafkagopublisher: Config.Compression: %q is not none, gzip, snappy, lz4 or zstd", c.Compression)
	}
	if c.Transport != nil && (c.Conn != kafkaconn.Config{}) {
		return nil, errors.New("kafkagopublisher: Config.Conn and Config.Transport are both set; set one")
	}
	var own *kafka.Transport
	if c.Transport == nil {
		t, err := kafkagoconn.Transport(c.Conn)
		if err != nil {
			return nil, fmt.Errorf("kafkagopublisher: Config.Conn.%w", err)
		}
		c.Transport, own = t, t
	}
	switch {
	case c.BatchTimeout < 0:
		return nil, fmt.Errorf("kafkagopublisher: Config.BatchTimeout must not be negative, got %s", c.BatchTimeout)
	case c.BatchBytes < 1024:
		return nil, fmt.Errorf("kafkagopublisher: Config.BatchBytes must be at least 1024, got %d", c.BatchBytes)
	case c.MaxAttempts < 1:
		return nil, fmt.Errorf("kafkagopublisher: Config.MaxAttempts must be at least 1, got %d", c.MaxAttempts)
	}
	addr := kafka.TCP(brokers...)
	newWriter := func() *kafka.Writer {
		return &kafka.Writer{
			Addr:                   addr,
			Balancer:               &kafka.Murmur2Balancer{},
			RequiredAcks:           kafka.RequireAll,
			BatchTimeout:           c.BatchTimeout,
			BatchSize:              100_000,
			BatchBytes:             c.BatchBytes,
			MaxAttempts:            c.MaxAttempts,
			AllowAutoTopicCreation: false,
			Compression:            codec,
			Transport:              c.Transport,
		}
	}
	lookCtx, stopLooks := context.WithCancel(context.Background())
	var prober *kafkagoconn.Prober
	if like, ok := c.Transport.(*kafka.Transport); ok {
		prober = kafkagoconn.NewProber(addr, like)
	}
	return &Publisher{own: own, prober: prober, batchBytes: c.BatchBytes, addr: addr, transport: c.Transport, newWriter: newWriter,
		lookCtx: lookCtx, stopLooks: stopLooks}, nil
}

// errClosed fails the records of a Publish call after Close.
var errClosed = errors.New("kafkagopublisher: publisher is closed")

// writer checks a Writer out for one Publish call; nil after Close.
func (p *Publisher) writer() *kafka.Writer {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	if n := len(p.free); n > 0 {
		w := p.free[n-1]
		p.free = p.free[:n-1]
		return w
	}
	w := p.newWriter()
	p.all = append(p.all, w)
	return w
}

// release puts back a Writer the call is done with.
func (p *Publisher) release(w *kafka.Writer) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.closed {
		p.free = append(p.free, w)
	}
}

// Publish writes records topic by topic and reports each record's outcome.
// kafka-go fails a whole call for one unknown topic or one oversized
// record, so records are grouped by topic and an oversized record is taken
// out and the rest written again.
//
// kafka-go writes a partition's records that do not fit one request as
// several requests, and a later one can succeed after an earlier one failed.
// So records go out in waves of at most BatchBytes in all (one request per
// partition, as the call has its Writer to itself), and a record whose key
// failed with a passing error in an earlier wave (or topic) is not sent: it
// fails too (G3).
func (p *Publisher) Publish(ctx context.Context, records []relay.Record) []error {
	errs := make([]error, len(records))
	w := p.writer()
	if w == nil {
		for i := range errs {
			errs[i] = errClosed
		}
		return errs
	}
	defer p.release(w)
	byTopic := map[string][]int{}
	var topics []string
	for i, r := range records {
		if _, ok := byTopic[r.Topic]; !ok {
			topics = append(topics, r.Topic)
		}
		byTopic[r.Topic] = append(byTopic[r.Topic], i)
	}
	p.lookUp(ctx, topics)
	failedKeys := map[string]bool{}
	for _, topic := range topics {
		idx := byTopic[topic]
		for len(idx) > 0 {
			n, size := 0, int64(0)
			for n < len(idx) {
				s := sizeOf(&records[idx[n]])
				if n > 0 && size+s > p.batchBytes {
					break
				}
				size += s
				n++
			}
			wave := make([]int, 0, n)
			for _, i := range idx[:n] {
				if k := records[i].Key; k != nil && failedKeys[string(k)] {
					errs[i] = errHeldBack
					continue
				}
				wave = append(wave, i)
			}
			idx = idx[n:]
			p.publishByPartition(ctx, w, topic, records, wave, errs)
			for _, i := range wave {
				// Any error stops the key: the relay retries unknown and
				// forbidden topics, and an invalid record may be the
				// whole batch's refusal and go through alone. Nor may a
				// record too large, which the relay dead-letters, let
				// its key's later records out before that is recorded.
				if errs[i] != nil && records[i].Key != nil {
					failedKeys[string(records[i].Key)] = true
				}
			}
		}
	}
	p.explainUnknown(ctx, records, errs)
	return errs
}

// explainUnknown asks by name about the topics whose records failed as
// unknown, and fails those the broker says this principal may not describe
// as forbidden. The Writer knows topics from its transport's list of every
// topic, from which Kafka leaves out a topic an ACL hides, so every
// not-yet-authorized topic reads as unknown there; the relay gives an
// unknown topic UnknownTopicGrace and a forbidden one TopicForbiddenGrace,
// and names the cause in the dead letter. A topic's answer is kept a few
// seconds, and stands while the brokers cannot be asked again
// (kafkagoconn.Prober); with no answer yet, the records stay unknown.
func (p *Publisher) explainUnknown(ctx context.Context, records []relay.Record, errs []error) {
	if p.prober == nil {
		return
	}
	var topics []string
	seen := map[string]bool{}
	for i, err := range errs {
		if t := records[i].Topic; errors.Is(err, relay.ErrUnknownTopic) && !seen[t] {
			seen[t] = true
			topics = append(topics, t)
		}
	}
	if len(topics) == 0 {
		return
	}
	forbidden := p.prober.Forbidden(ctx, topics)
	for i, e := range errs {
		if errors.Is(e, relay.ErrUnknownTopic) && forbidden[records[i].Topic] {
			errs[i] = fmt.Errorf("%w: %w (absent from the topics this principal may list; asked by name)",
				relay.ErrTopicForbidden, kafka.TopicAuthorizationFailed)
		}
	}
}

// errHeldBack fails a record not sent because an earlier record of its key
// failed.
var errHeldBack = fmt.Errorf("kafkagopublisher: %w: an earlier record of its key failed", relay.ErrNotSent)

// sizeOf is at least kafka-go's size of the record in a batch.
func sizeOf(r *relay.Record) int64 {
	n := int64(32 + len(r.Key) + len(r.Value))
	for _, h := range r.Headers {
		n += int64(10 + len(h.Key) + len(h.Value))
	}
	return n
}

// publishByPartition writes a wave's records of topic with one
// WriteMessages call per partition, at once: a call fails every record with
// ctx's error when ctx ends before all its partitions answered, so one
// partition that does not acknowledge must not fail its neighbours' records
// (a relay holds back the keys of a partition that failed; see
// relay.PartitionReporter). Records without a key, or of a topic whose
// partitions are not known yet, go in one call. A key's records are all in
// one call, in order.
func (p *Publisher) publishByPartition(ctx context.Context, w *kafka.Writer, topic string, records []relay.Record, idx []int, errs []error) {
	groups := map[int32][]int{}
	var order []int32
	for _, i := range idx {
		part, ok := p.Partition(topic, records[i].Key)
		if !ok {
			part = -1
		}
		if _, seen := groups[part]; !seen {
			order = append(order, part)
		}
		groups[part] = append(groups[part], i)
	}
	if len(order) <= 1 {
		publishWave(ctx, w, records, idx, errs)
		return
	}
	var wg sync.WaitGroup
	for _, part := range order {
		wg.Add(1)
		go func(g []int) {
			defer wg.Done()
			publishWave(ctx, w, records, g, errs) // disjoint indexes of errs
		}(groups[part])
	}
	wg.Wait()
}

func publishWave(ctx context.Context, w *kafka.Writer, records []relay.Record, idx []int, errs []error) {
	for len(idx) > 0 {
		msgs := make([]kafka.Message, len(idx))
		for j, i := range idx {
			msgs[j] = toMessage(records[i])
		}
		err := w.WriteMessages(ctx, msgs...)
		var tooLarge kafka.MessageTooLargeError
		var perMessage kafka.WriteErrors
		switch {
		case err == nil:
			return
		case errors.As(err, &tooLarge):
			// Find the offender (kafka-go returns a copy), fail it and
			// its key's later records (the relay dead-letters it, and
			// they must not be acknowledged before that is recorded:
			// G3), retry the rest.
			j := indexOf(msgs, tooLarge.Message)
			errs[idx[j]] = classify(err)
			key := records[idx[j]].Key
			rest := idx[:j:j]
			for _, i := range idx[j+1:] {
				if key != nil && records[i].Key != nil && bytes.Equal(records[i].Key, key) {
					errs[i] = errHeldBack
					continue
				}
				rest = append(rest, i)
			}
			idx = rest
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

// Ping checks that a broker answers (and accepts the connection's TLS and
// SASL settings). Publish retries an unreachable broker until ctx is done:
// Ping is how to tell sooner. Safe for concurrent use.
func (p *Publisher) Ping(ctx context.Context) error {
	cl := &kafka.Client{Addr: p.addr, Transport: p.transport}
	resp, err := cl.ApiVersions(ctx, &kafka.ApiVersionsRequest{Addr: p.addr})
	if err == nil && resp.Error != nil {
		err = resp.Error
	}
	if err != nil {
		return fmt.Errorf("kafkagopublisher: no broker answers: %w", err)
	}
	return nil
}

// Close flushes and closes the writers, and the connections of the
// transport New built. A Publish call after Close fails every record.
// It waits closeWait at most: kafka-go's Writer.Close waits for every write
// still in flight, a Publish its context abandoned included, and against a
// broker that does not answer that is MaxAttempts times the write timeout
// (51 s with the defaults), which held a stopping relay past its
// orchestrator's grace. Writes still in flight then end in the background,
// acknowledged or not (their events are pending: published again, never
// lost).
func (p *Publisher) Close() error {
	p.mu.Lock()
	all := p.all
	p.all, p.free, p.closed = nil, nil, true
	p.mu.Unlock()
	p.stopLooks()
	p.looking.Wait()
	closed := make(chan error, 1)
	go func() {
		errs := make([]error, 0, len(all))
		for _, w := range all {
			errs = append(errs, w.Close())
		}
		if p.own != nil {
			p.own.CloseIdleConnections()
		}
		closed <- errors.Join(errs...)
	}()
	t := time.NewTimer(closeWait)
	defer t.Stop()
	select {
	case err := <-closed:
		return err
	case <-t.C:
		return fmt.Errorf("kafkagopublisher: writes still in flight after %s; left to end in the background", closeWait)
	}
}

// closeWait bounds Close.
const closeWait = 5 * time.Second

func classify(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, kafka.MessageSizeTooLarge), errors.Is(err, kafka.RecordListTooLarge):
		return fmt.Errorf("%w: %w", relay.ErrRecordTooLarge, err)
	case errors.Is(err, kafka.TopicAuthorizationFailed):
		return fmt.Errorf("%w: %w", relay.ErrTopicForbidden, err)
	case errors.Is(err, kafka.InvalidTopic):
		return fmt.Errorf("%w: %w", relay.ErrTopicInvalid, err)
	case errors.Is(err, kafka.UnknownTopicOrPartition), errors.Is(err, kafka.UnknownTopicID):
		return fmt.Errorf("%w: %w", relay.ErrUnknownTopic, err)
	case errors.Is(err, kafka.InvalidRecord): // not InvalidMessage (CORRUPT_MESSAGE): Kafka retries that
		return fmt.Errorf("%w: %w", relay.ErrRecordInvalid, err)
	default:
		return err
	}
}
