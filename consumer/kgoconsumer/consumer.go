package kgoconsumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/internal/deadletter"
	"github.com/onceflow/onceflow/internal/kgoconn"
	"github.com/onceflow/onceflow/kafkaconn"
)

// Config configures a Consumer. Brokers and Topics are required.
type Config struct {
	// Brokers are the seed brokers (host:port). Required.
	Brokers []string
	// Topics are the topics to consume. Required.
	Topics []string
	// Group is the Kafka consumer group. Defaults to the Processor's name.
	Group string
	// Conn is how to reach the brokers: client id, TLS, SASL (ClientOpts
	// apply after it). Defaults to plaintext without authentication.
	Conn kafkaconn.Config
	// ClientOpts are extra franz-go options (TLS and SASL are simpler
	// through Conn): session and
	// rebalance timeouts, balancers, the reset offset for a new group
	// (franz-go's default is the start of each partition). Options the
	// Consumer depends on are applied after them and win: the group and
	// topics, AutoCommitMarks, BlockRebalanceOnPoll, OnPartitionsRevoked,
	// OnPartitionsLost, the read_committed isolation level and acks=all for
	// dead letters (kgo.DisableIdempotentWrite is honoured: a dead letter
	// may then be written twice). A dead-letter publish is bounded by
	// kgo.RecordDeliveryTimeout, 30s unless set here: past it the failure
	// is reported and the publish tried again. A dead letter's size is
	// bounded by kgo.ProducerBatchMaxBytes, 64 MiB (or
	// kgo.BrokerMaxWriteBytes if lower) unless set here, so that the
	// dead-letter topic's max.message.bytes is what refuses one too
	// large. Defaults to none.
	ClientOpts []kgo.Opt
	// CommitInterval is how often marked offsets are committed; they are
	// also committed when partitions are revoked (waiting half the
	// rebalance timeout at most) and at shutdown (10s at most), so Run
	// returns within ShutdownGrace and 10s while the coordinator refuses
	// commits, and within about 10s more while it does not answer them
	// (leaving the group waits out a commit's read timeout,
	// kgo.RequestTimeoutOverhead); what was not committed is delivered
	// again and skipped as a duplicate. Defaults to 1s.
	CommitInterval time.Duration
	// ShutdownGrace is how long a transaction in flight may take to finish
	// when the consumer stops, before its context is canceled and it
	// rolls back. Defaults to 5s.
	ShutdownGrace time.Duration
	// RevokeGrace is how long a transaction in flight may take to finish
	// when its partition is revoked in a rebalance, before its context is
	// canceled and it rolls back. The rebalance (and, with an eager
	// balancer, every partition of the member) waits for it, and the
	// member must rejoin within the rebalance timeout or be evicted, so it
	// is kept short: a handler stuck on a revoked partition holds the
	// rebalance up for RevokeGrace at most. Defaults to 1s, and never
	// exceeds a quarter of the client's rebalance timeout
	// (kgo.RebalanceTimeout, franz-go's default: 60s).
	RevokeGrace time.Duration
	// MaxPollRecords bounds the records taken per poll. Defaults to 1000.
	MaxPollRecords int
	// StopOnMissingDeadLetterTopic makes Run stop (draining and
	// committing what finished, as at shutdown) and return an error
	// wrapping consumer.ErrDeadLetterTopicMissing when a dead letter
	// cannot be published because its topic does not exist. Otherwise the
	// message's partition waits, retrying, with an Error log and a
	// consumer.HookDeadLetterFailed event per failed publish, until the
	// topic is created. onceflow never creates topics. Defaults to false.
	StopOnMissingDeadLetterTopic bool
	// Logger receives fetch and commit errors (Warn); a partition's fetch
	// failures at most once per 10s, with the count of those left out.
	// Defaults to slog.Default().
	Logger *slog.Logger
}

// Consumer runs a consumer.Processor over a franz-go consumer group. It is
// not safe to call Run more than once.
type Consumer struct {
	p   *consumer.Processor
	cfg Config
	log *slog.Logger
	// connOpts are Config.Conn as kgo options.
	connOpts []kgo.Opt
	// deadLetters has each dead letter judged alone for its size.
	deadLetters deadletter.Topics

	mu      sync.Mutex
	parts   map[tp]*partition
	procCtx context.Context // parent of every partition's work; see Run
	stopRun context.CancelFunc
	err     error // why Run stopped on its own
	// closing bounds the commits of Run's shutdown, the one the client
	// makes as it leaves the group (revoked) included; nil until then.
	closing context.Context
	// room is signaled when a partition's queue drained enough to take
	// more (consumer.QueueWaker): it ends a poll early while partitions
	// are paused with records pending.
	room chan struct{}
}

type tp struct {
	topic     string
	partition int32
}

// partition is one assigned partition: the core's worker plus records
// fetched but not yet queued (the partition is paused while there are any).
type partition struct {
	w       *consumer.Partition
	pending []consumer.Message
}

// New returns a Consumer for p; cfg is required for Brokers and Topics.
func New(p *consumer.Processor, cfg *Config) (*Consumer, error) {
	if p == nil {
		return nil, errors.New("kgoconsumer: processor is nil")
	}
	if cfg == nil {
		return nil, errors.New("kgoconsumer: Config.Brokers and Config.Topics are required")
	}
	c := *cfg
	if c.Group == "" {
		c.Group = p.Name()
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
	if c.MaxPollRecords == 0 {
		c.MaxPollRecords = 1000
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	switch {
	case len(c.Brokers) == 0:
		return nil, errors.New("kgoconsumer: Config.Brokers is required")
	case len(c.Topics) == 0:
		return nil, errors.New("kgoconsumer: Config.Topics is required")
	case c.CommitInterval < 0:
		return nil, errors.New("kgoconsumer: Config.CommitInterval must not be negative")
	case c.ShutdownGrace < 0:
		return nil, errors.New("kgoconsumer: Config.ShutdownGrace must not be negative")
	case c.RevokeGrace < 0:
		return nil, errors.New("kgoconsumer: Config.RevokeGrace must not be negative")
	case c.MaxPollRecords < 1:
		return nil, errors.New("kgoconsumer: Config.MaxPollRecords must be at least 1")
	}
	if err := kafkaconn.CheckBrokers(c.Brokers); err != nil {
		return nil, fmt.Errorf("kgoconsumer: Config.Brokers: %w", err)
	}
	connOpts, err := kgoconn.Opts(c.Conn)
	if err != nil {
		return nil, fmt.Errorf("kgoconsumer: Config.Conn.%w", err)
	}
	return &Consumer{p: p, cfg: c, connOpts: connOpts, log: c.Logger.With("consumer", p.Name(), "group", c.Group), parts: map[tp]*partition{},
		room: make(chan struct{}, 1)}, nil
}

// Run joins the group and processes messages until ctx is canceled, then
// drains (see Config.ShutdownGrace), commits what finished, leaves the group
// and returns nil. It returns an error when the client cannot start, or,
// after the same drain, when Config.StopOnMissingDeadLetterTopic stopped
// it.
func (c *Consumer) Run(ctx context.Context) error {
	procCtx, cancelProc := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelProc()
	outer := ctx
	ctx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	c.mu.Lock()
	c.procCtx = procCtx
	c.stopRun = stopRun
	c.mu.Unlock()

	opts := append([]kgo.Opt{kgo.SeedBrokers(c.cfg.Brokers...)}, c.connOpts...)
	// A dead letter the brokers answer with a retriable error for as long
	// as it lasts (NOT_ENOUGH_REPLICAS) was retried inside franz-go for
	// ever: its partition waited with no failure reported, so no metric
	// moved and no alert fired. Bounded, the failure reaches the Processor,
	// which reports it and tries again. ClientOpts may set another bound.
	opts = append(opts, kgo.RecordDeliveryTimeout(deadLetterDeliveryTimeout))
	// A dead letter is refused for its size by its topic, not by
	// franz-go's default limit (1,000,012 bytes): refused, it would go out
	// without the original's value though its topic takes it.
	// ClientOpts' own ProducerBatchMaxBytes, after it, wins.
	batchAt := len(opts)
	opts = append(opts, nil)
	opts = append(opts, c.cfg.ClientOpts...)
	opts = append(opts,
		kgo.ConsumerGroup(c.cfg.Group),
		kgo.ConsumeTopics(c.cfg.Topics...),
		kgo.AutoCommitMarks(),
		kgo.AutoCommitInterval(c.cfg.CommitInterval),
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsRevoked(c.revoked),
		kgo.OnPartitionsLost(c.lost),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		// A dead letter counts as written, and its message's offset is
		// committed, once its produce is acknowledged: without acks a
		// record the broker refuses counts as written, and with the
		// leader's alone it is lost if the leader fails before a
		// follower copied it.
		kgo.RequiredAcks(kgo.AllISRAcks()),
	)
	opts[batchAt] = kgo.ProducerBatchMaxBytes(deadLetterBatchMax(opts, batchAt))
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("kgoconsumer: client: %w", err)
	}

	fetchErrs := fetchErrorLog{}
	readopted := map[string]time.Time{}
	for {
		pollCtx, cancelPoll := ctx, context.CancelFunc(func() {})
		if c.hasPending() {
			// Paused partitions need their pending records fed as
			// their queues drain, so don't wait long for new fetches,
			// and not at all once a queue has room (a few large
			// messages drain in less than this wait).
			pollCtx, cancelPoll = context.WithTimeout(ctx, 20*time.Millisecond)
			go func() {
				select {
				case <-c.room:
					cancelPoll()
				case <-pollCtx.Done():
				}
			}()
		}
		fetches := cl.PollRecords(pollCtx, c.cfg.MaxPollRecords)
		cancelPoll()
		if fetches.IsClientClosed() || ctx.Err() != nil {
			break
		}
		var recreated []string
		fetches.EachError(func(topic string, p int32, err error) {
			if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				return
			}
			if errors.Is(err, kerr.UnknownTopicID) && !slices.Contains(recreated, topic) {
				recreated = append(recreated, topic)
			}
			fetchErrs.log(c.log, tp{topic, p}, err)
		})
		c.dispatch(cl, fetches)
		cl.AllowRebalance()
		for _, topic := range recreated {
			c.consumeAnew(cl, topic, readopted)
		}
	}

	// Shutdown: stop every partition (finishing in-flight work within the
	// grace), commit what finished, leave the group.
	c.stopAll(c.cfg.ShutdownGrace)
	commitCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownCommitWait)
	c.mu.Lock()
	c.closing = commitCtx
	c.mu.Unlock()
	if err := commitMarked(commitCtx, cl); err != nil {
		c.log.Warn("kgoconsumer: final commit failed; the last messages will be delivered again and skipped as duplicates", "error", err)
	}
	// Leaving the group waits for the commits in flight: against a
	// coordinator that does not answer, up to a request's read timeout
	// (kgo.RequestTimeoutOverhead, 10s by default) past the bound above; a
	// LeaveGroupContext given the bound's end did not shorten it.
	cl.CloseAllowingRebalance()
	cancel()
	if outer.Err() != nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// consumeAnew makes the client consume topic as a new topic, after its
// fetches failed with UNKNOWN_TOPIC_ID: the topic was deleted, and perhaps
// created again under its name. franz-go keeps fetching a topic by the id
// it first saw and never adopts a recreated topic's new one, so without
// this the partition would fail for good (see franz-go's README, "Topic
// recreation"). The topic's partitions are stopped first (their work in
// flight finishing within RevokeGrace), so that no offset of the old topic
// is marked once the client forgets it; purging drops the old topic's
// uncommitted offsets, and Kafka drops its committed ones, so the new topic
// is consumed from its start (or kgo.ConsumeResetOffset). A topic is made
// new at most once per recreatedTopicPause: franz-go also reports
// UNKNOWN_TOPIC_ID for a moment after a topic is first created.
func (c *Consumer) consumeAnew(cl *kgo.Client, topic string, last map[string]time.Time) {
	if time.Since(last[topic]) < recreatedTopicPause {
		return
	}
	last[topic] = time.Now()
	c.mu.Lock()
	var held []int32
	for key := range c.parts {
		if key.topic == topic {
			held = append(held, key.partition)
		}
	}
	c.mu.Unlock()
	c.log.Warn("kgoconsumer: a consumed topic was deleted, and perhaps created again; consuming it anew from the group's committed offset",
		"topic", topic)
	c.stop(cl, map[string][]int32{topic: held}, c.cfg.RevokeGrace)
	cl.PurgeTopicsFromConsuming(topic)
	cl.AddConsumeTopics(topic)
}

// deadLetterBatchMax returns the batch limit to set at opts[at]:
// deadletter.MaxBytes, or, when the options after it hold a
// kgo.BrokerMaxWriteBytes below that, the largest limit franz-go takes
// with them (their kgo.BrokerMaxWriteBytes): franz-go refuses a client
// whose batch limit is above its write limit. The options are only
// validated (kgo.ValidateOpts), never made into a client, which would run
// the hooks of ClientOpts (kgo.WithHooks) for a client thrown away. With
// options that fail for another reason, it returns deadletter.MaxBytes and
// kgo.NewClient reports them.
func deadLetterBatchMax(opts []kgo.Opt, at int) int32 {
	fits := func(n int32) bool {
		opts[at] = kgo.ProducerBatchMaxBytes(n)
		return kgo.ValidateOpts(opts...) == nil
	}
	const least = 1 << 10 // franz-go's least kgo.BrokerMaxWriteBytes
	if fits(deadletter.MaxBytes) || !fits(least) {
		return deadletter.MaxBytes
	}
	lo, hi := int32(least), int32(deadletter.MaxBytes) // fits(lo), !fits(hi)
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if fits(mid) {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo
}

// deadLetterDeliveryTimeout bounds one dead-letter publish.
const deadLetterDeliveryTimeout = 30 * time.Second

// recreatedTopicPause is the least time between two consumeAnew of a topic.
const recreatedTopicPause = 10 * time.Second

// fetchErrorLog logs a partition's fetch failures at most once per
// fetchErrorLogEvery, with how many it left out since: franz-go reports a
// failing partition on every poll, hundreds of times a second. It is used
// by Run's poll loop only.
type fetchErrorLog map[tp]*fetchErrorState

type fetchErrorState struct {
	logged  time.Time
	skipped int
}

const fetchErrorLogEvery = 10 * time.Second

func (l fetchErrorLog) log(log *slog.Logger, key tp, err error) {
	s := l[key]
	if s == nil {
		s = &fetchErrorState{}
		l[key] = s
	}
	if time.Since(s.logged) < fetchErrorLogEvery {
		s.skipped++
		return
	}
	log.Warn("kgoconsumer: fetch failed", "topic", key.topic, "partition", key.partition, "error", err,
		"repeats_not_logged", s.skipped)
	s.logged, s.skipped = time.Now(), 0
}

// fail stops Run with err, once.
func (c *Consumer) fail(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		c.err = err
		c.log.Error("kgoconsumer: stopping", "error", err)
		c.stopRun()
	}
}

func (c *Consumer) hasPending() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range c.parts {
		if len(p.pending) > 0 {
			return true
		}
	}
	return false
}

// dispatch queues fetched records on their partitions, pausing partitions
// whose queue is full rather than blocking (a blocked poll loop would stall
// every other partition and hold up rebalances).
func (c *Consumer) dispatch(cl *kgo.Client, fetches kgo.Fetches) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for key, p := range c.parts {
		if len(p.pending) == 0 {
			continue
		}
		n := p.w.TryAdd(p.pending)
		p.pending = p.pending[n:]
		if len(p.pending) == 0 {
			p.pending = nil
			cl.ResumeFetchPartitions(map[string][]int32{key.topic: {key.partition}})
		}
	}
	fetches.EachPartition(func(f kgo.FetchTopicPartition) {
		if len(f.Records) == 0 {
			return
		}
		key := tp{f.Topic, f.Partition}
		p := c.parts[key]
		if p == nil {
			p = &partition{w: c.p.StartPartition(c.procCtx, &transport{c: c, cl: cl})}
			c.parts[key] = p
		}
		msgs := make([]consumer.Message, len(f.Records))
		for i, r := range f.Records {
			msgs[i] = Message(r)
		}
		if len(p.pending) == 0 {
			n := p.w.TryAdd(msgs)
			msgs = msgs[n:]
			if len(msgs) == 0 {
				return
			}
			cl.PauseFetchPartitions(map[string][]int32{key.topic: {key.partition}})
		}
		p.pending = append(p.pending, msgs...)
	})
}

// revoked runs inside the client's rebalance: finish (or cancel after the
// grace) the revoked partitions' work, then commit what finished before the
// partitions move to another member.
func (c *Consumer) revoked(ctx context.Context, cl *kgo.Client, revoked map[string][]int32) {
	grace := c.cfg.RevokeGrace
	if rt, ok := cl.OptValue(kgo.RebalanceTimeout).(time.Duration); ok && rt > 0 {
		grace = min(grace, rt/4)
	}
	c.stop(cl, revoked, grace)
	c.mu.Lock()
	commitCtx, cancel := c.closing, context.CancelFunc(func() {})
	c.mu.Unlock()
	if commitCtx == nil {
		// Within the rebalance: a member that overstays it is evicted.
		commitCtx, cancel = context.WithTimeout(ctx, revokeCommitWait(cl))
	}
	defer cancel()
	if err := commitMarked(commitCtx, cl); err != nil {
		c.log.Warn("kgoconsumer: commit on revoke failed; those messages will be delivered again and skipped as duplicates", "error", err)
	}
}

// shutdownCommitWait bounds the commits of Run's shutdown.
const shutdownCommitWait = 10 * time.Second

// revokeCommitWait bounds the commit on revoke: half the rebalance timeout
// (the stop before it takes a quarter at most), 10 s if the client does not
// say.
func revokeCommitWait(cl *kgo.Client) time.Duration {
	if rt, ok := cl.OptValue(kgo.RebalanceTimeout).(time.Duration); ok && rt > 0 {
		return rt / 2
	}
	return shutdownCommitWait
}

// commitMarked commits the marked offsets, waiting no longer than ctx:
// franz-go queues a commit behind the one in flight, which retries a
// coordinator that refuses it (COORDINATOR_LOAD_IN_PROGRESS while a moved
// coordinator loads its offsets) for up to its retry timeout, and does not
// watch ctx while it waits its turn. A commit given up on may still land:
// its offsets were processed.
func commitMarked(ctx context.Context, cl *kgo.Client) error {
	done := make(chan error, 1)
	go func() { done <- cl.CommitMarkedOffsets(ctx) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// lost runs when partitions were taken away without a clean revoke (session
// expired): another member may already process them, so abandon at once and
// commit nothing.
func (c *Consumer) lost(_ context.Context, cl *kgo.Client, lost map[string][]int32) {
	c.stop(cl, lost, 0)
}

func (c *Consumer) stop(cl *kgo.Client, which map[string][]int32, grace time.Duration) {
	c.mu.Lock()
	var stopping []*partition
	for topic, ps := range which {
		for _, n := range ps {
			key := tp{topic, n}
			if p := c.parts[key]; p != nil {
				stopping = append(stopping, p)
				delete(c.parts, key)
			}
		}
	}
	c.mu.Unlock()
	cl.ResumeFetchPartitions(which)
	c.stopParts(stopping, grace)
}

func (c *Consumer) stopAll(grace time.Duration) {
	c.mu.Lock()
	stopping := make([]*partition, 0, len(c.parts))
	for key, p := range c.parts {
		stopping = append(stopping, p)
		delete(c.parts, key)
	}
	c.mu.Unlock()
	c.stopParts(stopping, grace)
}

// stopParts stops partitions in parallel, so the grace is shared. Work
// that ignores its canceled context is abandoned (consumer.Partition.Stop).
func (c *Consumer) stopParts(ps []*partition, grace time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	var wg sync.WaitGroup
	for _, p := range ps {
		wg.Add(1)
		go func() { defer wg.Done(); p.w.Stop(ctx) }()
	}
	wg.Wait()
}

// transport marks and dead-letters through the group's client.
type transport struct {
	c  *Consumer
	cl *kgo.Client
}

func (t *transport) MarkDone(msg consumer.Message) {
	if r, ok := msg.Raw.(*kgo.Record); ok {
		t.cl.MarkCommitRecords(r)
	}
}

// QueueRoom implements consumer.QueueWaker.
func (t *transport) QueueRoom() {
	select {
	case t.c.room <- struct{}{}:
	default:
	}
}

func (t *transport) PublishDeadLetter(ctx context.Context, d consumer.DeadLetter) error {
	r := &kgo.Record{Topic: d.Topic, Key: d.Key, Value: d.Value, Headers: make([]kgo.RecordHeader, len(d.Headers))}
	for i, h := range d.Headers {
		r.Headers[i] = kgo.RecordHeader{Key: h.Key, Value: h.Value}
	}
	// Refused as too large, it is tried again alone in its batch before
	// it loses its value (deadletter.Topics).
	err := t.c.deadLetters.Publish(ctx, d.Topic, func(ctx context.Context) error {
		err := t.cl.ProduceSync(ctx, r).FirstErr()
		if errors.Is(err, kerr.UnknownTopicID) {
			// The dead-letter topic was deleted since the client
			// first produced to it, and perhaps created again:
			// franz-go keeps producing by the old topic id until the
			// topic is purged from producing. Try once more by name:
			// a recreated topic takes the dead letter, a deleted one
			// fails as missing.
			t.cl.PurgeTopicsFromProducing(d.Topic)
			err = t.cl.ProduceSync(ctx, r).FirstErr()
		}
		return err
	}, tooLarge)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, kerr.UnknownTopicOrPartition):
		err = fmt.Errorf("kgoconsumer: publish dead letter to %s: %w: %w", d.Topic, consumer.ErrDeadLetterTopicMissing, err)
		if t.c.cfg.StopOnMissingDeadLetterTopic {
			t.c.fail(err)
		}
		return err
	case tooLarge(err):
		return fmt.Errorf("kgoconsumer: publish dead letter to %s: %w: %w", d.Topic, consumer.ErrDeadLetterTooLarge, err)
	case errors.Is(err, kerr.ClusterAuthorizationFailed):
		// franz-go keeps a refused producer id for the client's life: the
		// group's client never asks again, so a grant needs a restart.
		return fmt.Errorf("kgoconsumer: publish dead letter to %s: %w: the brokers refuse this principal idempotent writes; "+
			"grant it IdempotentWrite on the cluster (MSK with IAM: kafka-cluster:WriteDataIdempotently), then restart the consumer", d.Topic, err)
	default:
		return fmt.Errorf("kgoconsumer: publish dead letter to %s: %w", d.Topic, err)
	}
}

// tooLarge reports whether err refuses a record for its size: the client's
// limit (kgo.ProducerBatchMaxBytes) or the broker's.
func tooLarge(err error) bool {
	return errors.Is(err, kerr.MessageTooLarge) || errors.Is(err, kerr.RecordListTooLarge)
}

// Message converts a franz-go record; Raw holds r.
func Message(r *kgo.Record) consumer.Message {
	m := consumer.Message{
		Topic:     r.Topic,
		Partition: r.Partition,
		Offset:    r.Offset,
		Key:       r.Key,
		Value:     r.Value,
		Timestamp: r.Timestamp,
		Raw:       r,
	}
	if len(r.Headers) > 0 {
		m.Headers = make([]consumer.Header, len(r.Headers))
		for i, h := range r.Headers {
			m.Headers[i] = consumer.Header{Key: h.Key, Value: h.Value}
		}
	}
	return m
}
