// Package kgopublisher is the relay's default Publisher, on franz-go's kgo
// client: idempotent producer, acks=all, murmur2 key partitioning as the
// Java client does, retries of passing errors without limit (a broker outage
// is waited out, never turned into a refusal).
package kgopublisher

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/kgoconn"
	"github.com/onceflow/onceflow/kafkaconn"
	"github.com/onceflow/onceflow/relay"
)

// Config configures a Publisher. A nil *Config means all defaults.
type Config struct {
	// Conn is how to reach the brokers: client id, TLS, SASL. Defaults to
	// plaintext without authentication.
	Conn kafkaconn.Config
	// Linger is how long the client waits to fill a batch. Defaults to 0:
	// the relay already hands over whole batches.
	Linger time.Duration
	// Compression is the codec of produced batches: none, gzip, snappy,
	// lz4 or zstd. Defaults to snappy (franz-go's default).
	Compression string
	// MaxRecordBytes is the largest record batch the client sends, so the
	// largest record it accepts: a larger record is refused before it is
	// sent (relay.ErrRecordTooLarge, dead-lettered). Keep it at or below
	// the topic's max.message.bytes. Defaults to 1000012 (Kafka's default
	// max.message.bytes).
	MaxRecordBytes int32
	// Opts are extra kgo options applied last.
	// Options that break the relay's guarantees (kgo.DisableIdempotentWrite,
	// acks below all) are the caller's responsibility. Defaults to none.
	Opts []kgo.Opt
}

// Publisher publishes through a kgo.Client. Publish is safe for concurrent
// use; Close is idempotent.
//
// Publish returns when ctx is done (the relay's Config.PublishTimeout),
// failing what was not acknowledged. The records stay with the client:
// franz-go fails a partition's buffered records on their context once that
// is safe for the idempotent producer's sequence numbers (the request was
// answered, or never sent) and then bumps the producer epoch itself; a
// record it cannot fail yet may still land later, as a duplicate the
// relay's retry repeats (at least once), never ahead of its key's earlier
// records, which are in the same partition queue.
type Publisher struct {
	// cl is the client; New's is replaced when the brokers refuse it a
	// producer id (see replaceRefusedClient).
	cl atomic.Pointer[kgo.Client]
	// opts build New's client again; nil for NewFromClient's, which is
	// never replaced or closed.
	opts []kgo.Opt
	// replaceMu guards what follows: one replacement at a time, at most
	// once a replaceWait, and none after Close.
	replaceMu   sync.Mutex
	replacing   bool
	replacedAt  time.Time
	replaceWait time.Duration
	closed      bool
	// noClient: the refused client was closed and no new one could be
	// built; the next Publish tries again.
	noClient atomic.Bool
	// known holds the topics seen to exist, with their partition count
	// (for Partition). A record for any other topic is produced only once a
	// metadata request says the topic exists: franz-go retries an unknown
	// topic on its metadata refreshes (at most every MetadataMinAge, 5 s by
	// default), and the round would wait for that while the other keys
	// wait for the round. A topic looked up longer than metadataMaxAge ago
	// is looked up again with the next Publish that carries it.
	known sync.Map // topic → topicMeta
	// partitioner is the client's, for Partition.
	partitioner kgo.Partitioner
	// maxBatchBytes is the client's ProducerBatchMaxBytesFn, and
	// requestRoom what its BrokerMaxWriteBytes leaves a topic's batch (see
	// limit): a record that cannot fit a batch of its own is refused before
	// the call produces.
	maxBatchBytes func(topic string) int32
	requestRoom   int32
}

// topicMeta is what a metadata request said of a topic.
type topicMeta struct {
	partitions int
	at         time.Time
}

// metadataMaxAge is how long a topic's partition count is trusted before it
// is looked up again (partitions added): a stale count makes Partition
// wrong for that long, which costs the relay time, never order.
const metadataMaxAge = time.Minute

var (
	_ relay.Publisher         = (*Publisher)(nil)
	_ relay.PartitionReporter = (*Publisher)(nil)
)

// New connects to brokers. cfg may be nil.
func New(brokers []string, cfg *Config) (*Publisher, error) {
	if len(brokers) == 0 {
		return nil, errors.New("kgopublisher: no brokers given")
	}
	c := Config{}
	if cfg != nil {
		c = *cfg
	}
	if c.Compression == "" {
		c.Compression = "snappy"
	}
	if c.MaxRecordBytes == 0 {
		c.MaxRecordBytes = 1000012
	}
	if err := kafkaconn.CheckBrokers(brokers); err != nil {
		return nil, fmt.Errorf("kgopublisher: %w", err)
	}
	if c.Linger < 0 {
		return nil, fmt.Errorf("kgopublisher: Config.Linger must not be negative, got %s", c.Linger)
	}
	if c.MaxRecordBytes < 1024 {
		return nil, fmt.Errorf("kgopublisher: Config.MaxRecordBytes must be at least 1024, got %d", c.MaxRecordBytes)
	}
	codec, err := codec(c.Compression)
	if err != nil {
		return nil, err
	}
	connOpts, err := kgoconn.Opts(c.Conn)
	if err != nil {
		return nil, fmt.Errorf("kgopublisher: Config.Conn.%w", err)
	}
	opts := []kgo.Opt{
		kgo.SeedBrokers(brokers...),
		kgo.ProducerBatchCompression(codec),
		kgo.ProducerBatchMaxBytes(c.MaxRecordBytes),
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerLinger(c.Linger),
		// Unknown topics fail fast; the relay applies its own grace period.
		kgo.UnknownTopicRetries(2),
		kgo.RecordPartitioner(kgo.StickyKeyPartitioner(nil)),
	}
	opts = append(opts, connOpts...)
	opts = append(opts, c.Opts...)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("kgopublisher: %w", err)
	}
	return newPublisher(cl, opts), nil
}

func newPublisher(cl *kgo.Client, opts []kgo.Opt) *Publisher {
	part, _ := cl.OptValue(kgo.RecordPartitioner).(kgo.Partitioner)
	maxBytes, _ := cl.OptValue(kgo.ProducerBatchMaxBytesFn).(func(string) int32) // per topic, ProducerBatchMaxBytes too
	writeBytes, _ := cl.OptValue(kgo.BrokerMaxWriteBytes).(int32)
	id, _ := cl.OptValue(kgo.ClientID).(string)
	// What a produce request of one partition's batch spends besides the
	// batch, as the client counts it (its header with the client id, acks,
	// timeout, the topic's name, at least 16 bytes, and the arrays'
	// lengths); the topic's name is taken off per record.
	p := &Publisher{opts: opts, partitioner: part, maxBatchBytes: maxBytes, requestRoom: writeBytes - 37 - int32(len(id))}
	p.cl.Store(cl)
	return p
}

// NewFromClient publishes through a client you configured. Keep it
// idempotent with acks=all and murmur2 partitioning, or the relay's ordering
// promise weakens. Close does not close a client passed here, and the
// publisher cannot replace it: a client the brokers refused an idempotent
// producer id (see New) fails every record until you build another.
func NewFromClient(cl *kgo.Client) *Publisher { return newPublisher(cl, nil) }

// Partition implements relay.PartitionReporter: the partition the client's
// partitioner gives a record with key, among the topic's partitions as last
// looked up by Publish. ok is false for a topic not published to yet and
// for a record the partitioner does not place by its key alone (no key).
// Safe for concurrent use.
func (p *Publisher) Partition(topic string, key []byte) (int32, bool) {
	v, ok := p.known.Load(topic)
	if !ok || p.partitioner == nil {
		return 0, false
	}
	n := v.(topicMeta).partitions
	if n <= 0 {
		return 0, false
	}
	tp := p.partitioner.ForTopic(topic)
	rec := &kgo.Record{Topic: topic, Key: key}
	if !tp.RequiresConsistency(rec) {
		return 0, false
	}
	return int32(tp.Partition(rec, n)), true
}

// Publish produces records and waits for every acknowledgement, or for ctx.
func (p *Publisher) Publish(ctx context.Context, records []relay.Record) []error {
	if p.noClient.Load() {
		p.replaceRefusedClient(p.cl.Load())
	}
	cl := p.cl.Load()
	errs := make([]error, len(records))
	finished := make([]bool, len(records))
	pending := len(records)
	unknown := p.unknownTopics(ctx, cl, records)
	for i := range records {
		if err, ok := unknown[records[i].Topic]; ok {
			errs[i], finished[i] = classify(err), true
			pending--
		}
	}
	pending -= p.refuseOversized(records, errs, finished)
	if pending == 0 {
		return errs
	}
	// The client's records and their headers: one allocation each for the
	// call, taken from callPool and put back once every promise has been
	// called (the client refers to a record until then, not after).
	c := callPool.Get().(*call)
	nHeaders := 0
	for i := range records {
		nHeaders += len(records[i].Headers)
	}
	krs := slices.Grow(c.krs[:0], len(records))[:len(records)]
	headers := slices.Grow(c.headers[:0], nHeaders)
	for i, rec := range records {
		if finished[i] {
			continue // its topic does not exist
		}
		kr := &krs[i]
		kr.Topic, kr.Key, kr.Value = rec.Topic, rec.Key, rec.Value
		if len(rec.Headers) > 0 {
			start := len(headers)
			for _, h := range rec.Headers {
				headers = append(headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
			}
			kr.Headers = headers[start:len(headers):len(headers)]
		}
	}
	c.krs, c.headers = krs, headers
	done := make(chan struct{})
	var mu sync.Mutex
	// staleIDs are the topics the brokers no longer know by the id the
	// client produces with: deleted, and perhaps created again (see
	// adoptNewTopicIDs).
	var staleIDs []string
	// refused: the brokers refused the client an idempotent producer id.
	var refused bool
	// One promise for every record (the client calls promises one at a
	// time, with the record it was given): a closure per record was an
	// allocation per event. The record's index is its place in krs.
	base := uintptr(unsafe.Pointer(unsafe.SliceData(krs)))
	promise := func(kr *kgo.Record, err error) {
		i := int((uintptr(unsafe.Pointer(kr)) - base) / unsafe.Sizeof(kgo.Record{}))
		if i < 0 || i >= len(krs) || &krs[i] != kr {
			// Never: the client hands each promise the record it was
			// given. Taking another record's outcome could delete an
			// event that was not published.
			panic("kgopublisher: a promise for a record this call did not produce")
		}
		mu.Lock()
		defer mu.Unlock()
		if errs == nil {
			return // Publish already returned on ctx
		}
		errs[i] = classify(err)
		if errors.Is(err, kerr.ClusterAuthorizationFailed) {
			refused = true
		}
		if errors.Is(err, kerr.UnknownTopicOrPartition) {
			p.known.Delete(records[i].Topic) // deleted since: ask again
		}
		if errors.Is(err, kerr.UnknownTopicID) && !slices.Contains(staleIDs, records[i].Topic) {
			p.known.Delete(records[i].Topic)
			staleIDs = append(staleIDs, records[i].Topic)
		}
		finished[i] = true
		pending--
		if pending == 0 {
			close(done)
		}
	}
	for i := range krs {
		if !finished[i] {
			cl.Produce(ctx, &krs[i], promise)
		}
	}
	select {
	case <-done:
		c.put()
		adoptNewTopicIDs(cl, staleIDs)
		if refused {
			p.replaceRefusedClient(cl)
		}
		return errs
	case <-ctx.Done():
	}
	// Records still in flight may yet land: the relay treats them as not
	// acknowledged and publishes them again later (at least once). The
	// client still holds them: c is not reused.
	mu.Lock()
	out, stale, wasRefused := errs, staleIDs, refused
	errs = nil // later promises return at once: finished no longer changes
	mu.Unlock()
	why := "before the call was cancelled (shutdown)"
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		why = "within the call's deadline (the relay's publish timeout)"
	}
	for i := range out {
		if !finished[i] {
			out[i] = fmt.Errorf("kgopublisher: not acknowledged %s: %w", why, ctx.Err())
		}
	}
	adoptNewTopicIDs(cl, stale)
	if wasRefused {
		p.replaceRefusedClient(cl)
	}
	return out
}

// The first refusal replaces the client at once; while refusals go on,
// the next replacements wait 2, 4, 8, 16, then 30 s (maxReplaceWait): each
// connects (and authenticates) afresh and asks for a producer id, and
// managed clusters limit new connections. After a quiet 2*maxReplaceWait,
// a refusal replaces it at once again.
const (
	minReplaceWait = time.Second
	maxReplaceWait = 30 * time.Second
)

// flushBeforeReplace bounds how long a refused client's records in flight
// are waited for before it is closed.
const flushBeforeReplace = 10 * time.Second

// replaceRefusedClient starts replacing refused, a client New built, by a
// new one of the same options, if its producer id was refused for good
// and it is still the publisher's client. It does not wait: Publish
// returns when its ctx is done, and a replacement waits for the old
// client's requests in flight.
//
// A broker refuses an idempotent producer id with
// CLUSTER_AUTHORIZATION_FAILED when the principal lacks IdempotentWrite on
// the cluster (MSK with IAM: kafka-cluster:WriteDataIdempotently). That is
// mended by a grant, but franz-go keeps such a refusal as the client's
// producer id for its life and never asks again (the Java client asks
// again: KAFKA-13668): the relay would retry a client that cannot produce
// for as long as it ran. A new client asks again. The same error in a
// produce response fails only that batch and leaves the producer id
// alone: the client is kept.
func (p *Publisher) replaceRefusedClient(refused *kgo.Client) {
	if p.opts == nil {
		return // the caller's client
	}
	p.replaceMu.Lock()
	defer p.replaceMu.Unlock()
	if time.Since(p.replacedAt) > 2*maxReplaceWait {
		p.replaceWait = minReplaceWait
	}
	if p.closed || p.replacing || p.cl.Load() != refused || time.Since(p.replacedAt) < p.replaceWait {
		return
	}
	p.replacing = true
	go p.replace(refused)
}

// replace closes refused, if its producer id is refused for good, and
// builds its successor. The old client goes first: options may hold state
// of one client at a time (kprom's hooks register a client's metrics when
// it is built and unregister them when it closes; two at once panic). It
// is flushed first, bounded by flushBeforeReplace: without a producer id
// it sends nothing and its records fail at once, but the other Publish
// call may have records in flight, and these are let finish rather than
// failed while they may still land. Publish calls on the old client
// meanwhile fail with the refusal or kgo.ErrClientClosed, passing errors.
func (p *Publisher) replace(refused *kgo.Client) {
	closedOld := p.noClient.Load() // refused was closed and no successor built
	defer func() {
		p.replaceMu.Lock()
		defer p.replaceMu.Unlock()
		p.replacing = false
		if p.closed && !closedOld && p.cl.Load() == refused {
			refused.Close() // Close left it to the replacement
		}
	}()
	if !closedOld {
		ctx, cancel := context.WithTimeout(context.Background(), flushBeforeReplace)
		_, _, err := refused.ProducerID(ctx) // the stored refusal, without I/O
		cancel()
		if !errors.Is(err, kerr.ClusterAuthorizationFailed) {
			return // refused in a produce response only, or since mended
		}
		p.replaceMu.Lock()
		closed := p.closed
		p.replacedAt = time.Now()
		p.replaceWait = min(2*p.replaceWait, maxReplaceWait)
		p.replaceMu.Unlock()
		if closed {
			return
		}
		ctx, cancel = context.WithTimeout(context.Background(), flushBeforeReplace)
		_ = refused.Flush(ctx)
		cancel()
		refused.Close()
		closedOld = true
	}
	p.replaceMu.Lock()
	defer p.replaceMu.Unlock()
	if p.closed {
		return
	}
	cl, err := kgo.NewClient(p.opts...)
	if err != nil {
		// Never seen: these options built a client before. The closed
		// client fails every record, a passing error, until then.
		p.noClient.Store(true)
		return
	}
	p.cl.Store(cl)
	p.noClient.Store(false)
}

// refuseOversized fails, before anything of the call is produced, each
// record that cannot fit a batch of its own (the client would refuse it for
// its size), and keeps its key's later records in the call unsent: the
// client refuses such a record on its own while it produces the next ones,
// so a key's later record could be acknowledged in the same call, before
// the relay has dead-lettered the refused one. Were that dead letter then
// lost (the relay killed first) and the record accepted later (a larger
// limit), it would reach Kafka after its key's later record (G3). A record
// within nearLimit of the limit, which the client may count over it, is
// produced, but its key's later records wait for a later call too. It
// returns how many records it failed.
func (p *Publisher) refuseOversized(records []relay.Record, errs []error, finished []bool) int {
	if p.maxBatchBytes == nil {
		return 0
	}
	var stopped map[string]bool // keys whose later records are not sent
	stop := func(key []byte) {
		if key != nil {
			if stopped == nil {
				stopped = map[string]bool{}
			}
			stopped[string(key)] = true
		}
	}
	failed := 0
	for i := range records {
		if finished[i] {
			continue
		}
		r := &records[i]
		if r.Key != nil && stopped[string(r.Key)] {
			errs[i], finished[i] = errHeldBack, true
			failed++
			continue
		}
		limit := p.limit(r.Topic)
		switch size := minBatchBytes(r); {
		case size > limit:
			errs[i], finished[i] = fmt.Errorf("%w: %w (a batch of it alone takes at least %d bytes; the client's limit is %d)",
				relay.ErrRecordTooLarge, kerr.MessageTooLarge, size, limit), true
			failed++
			stop(r.Key)
		case size > limit-nearLimit:
			stop(r.Key)
		}
	}
	return failed
}

// limit is the largest record batch the client sends to topic: its
// ProducerBatchMaxBytesFn's, unless a produce request of BrokerMaxWriteBytes
// leaves less room.
func (p *Publisher) limit(topic string) int {
	limit := p.maxBatchBytes(topic)
	if p.requestRoom > 0 {
		limit = min(limit, p.requestRoom-int32(max(16, len(topic))))
	}
	return int(limit)
}

// nearLimit is how far below the client's limit a record may still be
// refused by it: minBatchBytes counts the record batch's header at its
// least, and the client a few bytes more (a flexible request's length
// prefix, a produce version not known yet).
const nearLimit = 128

// errHeldBack fails a record not sent behind an earlier record of its key
// in the call.
var errHeldBack = fmt.Errorf("kgopublisher: %w: an earlier record of its key was refused or may be", relay.ErrNotSent)

// minBatchBytes is the size of a record batch holding r alone, as franz-go
// counts it against ProducerBatchMaxBytes at the least (the record batch
// format's 61-byte header; a client that does not know the broker's produce
// version yet counts more), so a record over the limit here is over it
// there too.
func minBatchBytes(r *relay.Record) int {
	const batchHeader = 61
	n := 1 + varintLen(0) + varintLen(0) + // attributes, timestamp and offset deltas
		varintLen(len(r.Key)) + len(r.Key) + varintLen(len(r.Value)) + len(r.Value) + varintLen(len(r.Headers))
	for _, h := range r.Headers {
		n += varintLen(len(h.Key)) + len(h.Key) + varintLen(len(h.Value)) + len(h.Value)
	}
	return batchHeader + varintLen(n) + n
}

// varintLen is the length of n as a zigzag varint.
func varintLen(n int) int {
	var buf [binary.MaxVarintLen64]byte
	return binary.PutVarint(buf[:], int64(n))
}

// call holds one Publish's records as the client sees them, for reuse by
// later calls (callPool): a round's kgo.Records were a tenth of the relay's
// allocations in a drain.
type call struct {
	krs     []kgo.Record
	headers []kgo.RecordHeader
}

var callPool = sync.Pool{New: func() any { return new(call) }}

// put clears c, so that the pool keeps no keys or values alive and the next
// call's records start zero (the client fills in a record's timestamp,
// partition, offset and context), and puts it back in callPool.
func (c *call) put() {
	clear(c.krs)
	clear(c.headers)
	c.krs, c.headers = c.krs[:0], c.headers[:0]
	callPool.Put(c)
}

// adoptNewTopicIDs makes the client forget what it knows of producing to
// topics, so that it looks them up again by name. Kafka 4's Produce names a
// topic by its id; a topic deleted and created again under its name has a
// new one, and franz-go keeps producing with the old id (failing with
// UNKNOWN_TOPIC_ID) until the topic is purged from producing: the relay
// would dead-letter an existing topic's events after UnknownTopicGrace.
// Records of these topics still buffered by a concurrent call fail and are
// published again by the relay; a topic that is gone for good is then
// found unknown by name.
func adoptNewTopicIDs(cl *kgo.Client, topics []string) {
	if len(topics) > 0 {
		cl.PurgeTopicsFromProducing(topics...)
	}
}

// unknownTopics asks the cluster, in one metadata request, about the topics
// of records not known to exist yet (or looked up more than metadataMaxAge
// ago), and returns those it says do not. If the request fails, it returns
// none: the produce finds out itself.
func (p *Publisher) unknownTopics(ctx context.Context, cl *kgo.Client, records []relay.Record) map[string]error {
	var ask []string
	now := time.Now()
	for i := range records {
		t := records[i].Topic
		v, ok := p.known.Load(t)
		if ok && now.Sub(v.(topicMeta).at) <= metadataMaxAge || slices.Contains(ask, t) {
			continue
		}
		if ok {
			// Ask again in a minute if this look fails (an outage):
			// not on every call until it answers.
			p.known.Store(t, topicMeta{partitions: v.(topicMeta).partitions, at: now})
		}
		ask = append(ask, t)
	}
	if len(ask) == 0 {
		return nil
	}
	req := kmsg.NewPtrMetadataRequest()
	for _, t := range ask {
		rt := kmsg.NewMetadataRequestTopic()
		rt.Topic = kmsg.StringPtr(t)
		req.Topics = append(req.Topics, rt)
	}
	req.AllowAutoTopicCreation, _ = cl.OptValue(kgo.AllowAutoTopicCreation).(bool)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return nil
	}
	var out map[string]error
	for _, t := range resp.Topics {
		if t.Topic == nil {
			continue
		}
		switch err := kerr.ErrorForCode(t.ErrorCode); {
		case err == nil:
			p.known.Store(*t.Topic, topicMeta{partitions: len(t.Partitions), at: now})
		case errors.Is(err, kerr.UnknownTopicOrPartition):
			p.known.Delete(*t.Topic)
			if out == nil {
				out = map[string]error{}
			}
			out[*t.Topic] = err
		}
	}
	return out
}

// Ping checks that a broker answers (and accepts the connection's TLS and
// SASL settings). Publish never fails for an unreachable broker, it waits:
// Ping is how to tell. Safe for concurrent use.
func (p *Publisher) Ping(ctx context.Context) error {
	if p.noClient.Load() {
		// A relay judged cut off from Kafka owns no shards and may not
		// call Publish, which would otherwise try again.
		p.replaceRefusedClient(p.cl.Load())
	}
	if err := p.cl.Load().Ping(ctx); err != nil {
		return fmt.Errorf("kgopublisher: no broker answers: %w", err)
	}
	return nil
}

// Close closes the client if New created it.
func (p *Publisher) Close() error {
	if p.opts == nil {
		return nil
	}
	p.replaceMu.Lock()
	defer p.replaceMu.Unlock()
	if !p.closed {
		p.closed = true
		if !p.noClient.Load() && !p.replacing {
			p.cl.Load().Close() // a replacement under way closes it
		}
	}
	return nil
}

func codec(name string) (kgo.CompressionCodec, error) {
	switch name {
	case "none":
		return kgo.NoCompression(), nil
	case "gzip":
		return kgo.GzipCompression(), nil
	case "snappy":
		return kgo.SnappyCompression(), nil
	case "lz4":
		return kgo.Lz4Compression(), nil
	case "zstd":
		return kgo.ZstdCompression(), nil
	default:
		return kgo.CompressionCodec{}, fmt.Errorf("kgopublisher: Config.Compression: %q is not none, gzip, snappy, lz4 or zstd", name)
	}
}

func classify(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, kerr.MessageTooLarge), errors.Is(err, kerr.RecordListTooLarge):
		return fmt.Errorf("%w: %w", relay.ErrRecordTooLarge, err)
	case errors.Is(err, kerr.TopicAuthorizationFailed):
		return fmt.Errorf("%w: %w", relay.ErrTopicForbidden, err)
	case errors.Is(err, kerr.InvalidTopicException):
		return fmt.Errorf("%w: %w", relay.ErrTopicInvalid, err)
	case errors.Is(err, kerr.UnknownTopicOrPartition), errors.Is(err, kerr.UnknownTopicID):
		return fmt.Errorf("%w: %w", relay.ErrUnknownTopic, err)
	case errors.Is(err, kerr.InvalidRecord):
		return fmt.Errorf("%w: %w", relay.ErrRecordInvalid, err)
	case errors.Is(err, kerr.ClusterAuthorizationFailed):
		// Passing: a grant mends it, and every topic is refused alike.
		return fmt.Errorf("kgopublisher: %w: the brokers refuse this principal idempotent writes; grant it IdempotentWrite on the cluster (MSK with IAM: kafka-cluster:WriteDataIdempotently)", err)
	default:
		return err
	}
}
