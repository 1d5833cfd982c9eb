package kafkagoconsumer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"

	"github.com/onceflow/onceflow/consumer"
)

// fetcher fetches one assigned partition and queues its records on the
// partition's worker, blocking only itself when the worker's queue is full.
type fetcher struct {
	c         *Consumer
	g         *generation
	w         *consumer.Partition
	topic     string
	partition int
	// offset is the next offset to fetch, or kafka.FirstOffset or
	// kafka.LastOffset until it is resolved.
	offset int64
}

// run fetches until ctx (the generation) ends; from a partition whose
// topic is gone it fetches no more in this generation.
func (f *fetcher) run(ctx context.Context) {
	r := f.c.cfg.Reader
	wait := r.ReadBackoffMin
	for ctx.Err() == nil {
		err := f.fetchOnce(ctx)
		if err == nil {
			wait = r.ReadBackoffMin
			continue
		}
		if ctx.Err() != nil || errors.Is(err, consumer.ErrStopped) {
			return
		}
		if topicGone(err) {
			// The topic was deleted, and may be created again under its
			// name at any moment: the offset fetched up to belongs to the
			// old topic, and fetching it from the new one would skip every
			// message below it. So the partition stops here for this
			// generation, committing nothing more. It does not end the
			// generation: a rejoin while the topic is gone would have the
			// group's leader ask for its partitions the way kafka-go does,
			// allowing the broker to create it again (Kafka's default
			// auto.create.topics.enable). watchPartitions ends the
			// generation once the topic exists again; Kafka dropped the
			// old topic's committed offsets, so the next generation starts
			// the new one at Reader.StartOffset.
			f.g.forget(tp{f.topic, f.partition})
			f.c.log.Warn("kafkagoconsumer: the partition's topic is gone (deleted, perhaps created again); the partition waits for the topic to exist, then the group rejoins to start it over",
				"topic", f.topic, "partition", f.partition, "offset", f.offset, "error", err)
			<-ctx.Done()
			return
		}
		if errors.Is(err, kafka.OffsetOutOfRange) {
			f.c.log.Warn("kafkagoconsumer: offset out of range; starting over from Reader.StartOffset",
				"topic", f.topic, "partition", f.partition, "offset", f.offset, "error", err)
			f.offset = f.c.group.StartOffset
		} else {
			f.c.fetchErrs.log(f.c.log, tp{f.topic, f.partition}, f.offset, err)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, r.ReadBackoffMax)
	}
}

// topicGone reports whether a fetch or an offset lookup failed because
// the partition's topic does not exist (any more).
func topicGone(err error) bool {
	return errors.Is(err, kafka.UnknownTopicOrPartition) || errors.Is(err, kafka.UnknownTopicID)
}

// fetchOnce resolves the start offset if need be, fetches once, and queues
// what it got.
func (f *fetcher) fetchOnce(ctx context.Context) error {
	r := f.c.cfg.Reader
	if f.offset < 0 {
		res, err := f.c.client.ListOffsets(ctx, &kafka.ListOffsetsRequest{
			Topics:         map[string][]kafka.OffsetRequest{f.topic: {{Partition: f.partition, Timestamp: f.offset}}},
			IsolationLevel: r.IsolationLevel,
		})
		if err != nil {
			return fmt.Errorf("list offsets: %w", err)
		}
		for _, p := range res.Topics[f.topic] {
			if p.Partition != f.partition {
				continue
			}
			if p.Error != nil {
				return fmt.Errorf("list offsets: %w", p.Error)
			}
			if f.offset == kafka.FirstOffset {
				f.offset = p.FirstOffset
			} else {
				f.offset = p.LastOffset
			}
		}
		if f.offset < 0 {
			return errors.New("list offsets: partition missing from the answer")
		}
	}
	res, err := f.c.client.Fetch(ctx, &kafka.FetchRequest{
		Topic:          f.topic,
		Partition:      f.partition,
		Offset:         f.offset,
		MinBytes:       int64(r.MinBytes),
		MaxBytes:       int64(r.MaxBytes),
		MaxWait:        r.MaxWait,
		IsolationLevel: r.IsolationLevel,
	})
	if err != nil {
		return err
	}
	if res.Error != nil {
		return res.Error
	}
	delivered, last, err := f.queue(ctx, res)
	if err != nil || delivered || last < 0 {
		return err
	}
	// The answer held batches but no record at or past the offset: the
	// log cleaner removed the tail of the last batch (or all of it, an
	// empty batch kept for its producer's state). Such a batch keeps its
	// last offset, which kafka-go does not expose, and a fetch at any
	// offset up to it returns it again: fetched from f.offset, the
	// partition would stall for good (kafka-go's own Reader does, its
	// issues 621 and 807). pastBatch finds the offset just past it.
	next, err := f.pastBatch(ctx, last, max(f.offset, last), res.HighWatermark)
	if err != nil {
		return fmt.Errorf("pass a batch compaction emptied (from offset %d): %w", f.offset, err)
	}
	f.offset = next
	return nil
}

// pastBatch returns the offset just past the batch whose first offset is
// base, given that a fetch at lo (base <= lo) returns that batch and that
// it holds no record at or past lo. A fetch at offset p is answered from
// the first batch whose last offset is p or more, so the batch is
// returned for every p up to its last offset and never past it: pastBatch
// doubles its step from lo until a fetch returns something else (a later
// batch, nothing, or out of range past the log's end), then bisects back
// to the least such offset. Every offset from lo to the result lies in the
// batch and holds no record (compaction only removes records, and batches
// do not overlap), so no record is skipped, whatever a fetch past the
// batch's end found; if the batch is cleaned away meanwhile, the result
// is only smaller. Each probe asks for one byte, so it carries the first
// batch alone (Kafka returns a first batch whole), without waiting.
func (f *fetcher) pastBatch(ctx context.Context, base, lo, end int64) (int64, error) {
	same := func(p int64) (bool, error) {
		res, err := f.c.client.Fetch(ctx, &kafka.FetchRequest{
			Topic:          f.topic,
			Partition:      f.partition,
			Offset:         p,
			MinBytes:       0,
			MaxBytes:       1,
			MaxWait:        time.Millisecond,
			IsolationLevel: f.c.cfg.Reader.IsolationLevel,
		})
		switch {
		case err != nil:
			return false, err
		case errors.Is(res.Error, kafka.OffsetOutOfRange):
			return false, nil
		case res.Error != nil:
			return false, res.Error
		}
		first, ok := firstBatch(res.Records)
		return ok && first == base, nil
	}
	hi := int64(-1)
	for step := int64(1); hi < 0; step *= 2 {
		p := lo + step
		if p < lo { // overflow
			p = math.MaxInt64
		}
		if end > lo && p > end {
			// The batch ends below the high watermark.
			p = end
		}
		in, err := same(p)
		if err != nil {
			return 0, err
		}
		if in {
			lo = p
		} else {
			hi = p
		}
	}
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		in, err := same(mid)
		if err != nil {
			return 0, err
		}
		if in {
			lo = mid
		} else {
			hi = mid
		}
	}
	return hi, nil
}

// offsetReader is a batch of records: its Offset is its first offset.
type offsetReader interface{ Offset() int64 }

// batches returns the record batches of a fetched partition's records.
func batches(records protocol.RecordReader) []protocol.RecordReader {
	if s, ok := records.(*protocol.RecordStream); ok {
		// kafka-go's RecordStream hides control batches; walk its
		// batches to see them.
		return s.Records
	}
	return []protocol.RecordReader{records}
}

// firstBatch returns the first offset of records' first batch, false when
// there is none.
func firstBatch(records protocol.RecordReader) (int64, bool) {
	for _, b := range batches(records) {
		if o, ok := b.(offsetReader); ok {
			return o.Offset(), true
		}
	}
	return 0, false
}

// queue hands the fetched records to the worker in offset order. Records
// of control batches (transaction commit and abort markers, told apart by
// the batch's control attribute, as the protocol defines them) only move
// the offset on: they are queued with AddSkip so that their offsets are
// committed in order with the messages around them. Every other record is
// a message, whatever its key and value look like. It reports whether it
// queued any record, and the first offset of the last batch, -1 with
// none.
func (f *fetcher) queue(ctx context.Context, res *kafka.FetchResponse) (delivered bool, last int64, err error) {
	last = -1
	for _, b := range batches(res.Records) {
		if o, ok := b.(offsetReader); ok {
			last = o.Offset()
		}
		_, control := b.(*protocol.ControlBatch)
		for {
			rec, err := b.ReadRecord()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return delivered, last, fmt.Errorf("read records: %w", err)
			}
			m, err := f.message(rec, res.HighWatermark)
			if err != nil {
				return delivered, last, err
			}
			if m.Offset < f.offset {
				continue // a batch may start before the offset fetched
			}
			if control {
				err = f.w.AddSkip(ctx, Message(m))
			} else {
				err = f.w.Add(ctx, Message(m))
			}
			if err != nil {
				return delivered, last, err
			}
			f.offset = m.Offset + 1
			delivered = true
		}
	}
	return delivered, last, nil
}

// fetchErrorLog logs a partition's fetch failures at most once per
// fetchErrorLogEvery, with how many it left out since: each partition
// retries a failed fetch every Reader.ReadBackoffMax at most, so an outage
// would otherwise write a line per partition per second. It is kept for
// Run's life, across generations. Safe for concurrent use.
type fetchErrorLog struct {
	mu sync.Mutex
	m  map[tp]*fetchErrorState
}

type fetchErrorState struct {
	logged  time.Time
	skipped int
}

const fetchErrorLogEvery = 10 * time.Second

func (l *fetchErrorLog) log(log *slog.Logger, key tp, offset int64, err error) {
	l.mu.Lock()
	if l.m == nil {
		l.m = map[tp]*fetchErrorState{}
	}
	s := l.m[key]
	if s == nil {
		s = &fetchErrorState{}
		l.m[key] = s
	}
	if time.Since(s.logged) < fetchErrorLogEvery {
		s.skipped++
		l.mu.Unlock()
		return
	}
	skipped := s.skipped
	s.logged, s.skipped = time.Now(), 0
	l.mu.Unlock()
	log.Warn("kafkagoconsumer: fetch failed; retrying", "topic", key.topic, "partition", key.partition,
		"offset", offset, "error", err, "repeats_not_logged", skipped)
}

func (f *fetcher) message(rec *protocol.Record, hwm int64) (kafka.Message, error) {
	defer func() {
		if rec.Key != nil {
			rec.Key.Close()
		}
		if rec.Value != nil {
			rec.Value.Close()
		}
	}()
	key, err := protocol.ReadAll(rec.Key)
	if err != nil {
		return kafka.Message{}, fmt.Errorf("read record key: %w", err)
	}
	value, err := protocol.ReadAll(rec.Value)
	if err != nil {
		return kafka.Message{}, fmt.Errorf("read record value: %w", err)
	}
	return kafka.Message{
		Topic:         f.topic,
		Partition:     f.partition,
		Offset:        rec.Offset,
		HighWaterMark: hwm,
		Key:           key,
		Value:         value,
		Headers:       rec.Headers,
		Time:          rec.Time,
	}, nil
}
