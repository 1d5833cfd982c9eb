package kafkagoconsumer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
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
	return f.queue(ctx, res)
}

// queue hands the fetched records to the worker in offset order. Records
// of control batches (transaction commit and abort markers, told apart by
// the batch's control attribute, as the protocol defines them) only move
// the offset on: they are queued with AddSkip so that their offsets are
// committed in order with the messages around them. Every other record is
// a message, whatever its key and value look like.
func (f *fetcher) queue(ctx context.Context, res *kafka.FetchResponse) error {
	batches := []protocol.RecordReader{res.Records}
	if s, ok := res.Records.(*protocol.RecordStream); ok {
		// kafka-go's RecordStream hides control batches; walk its
		// batches to see them.
		batches = s.Records
	}
	for _, b := range batches {
		_, control := b.(*protocol.ControlBatch)
		for {
			rec, err := b.ReadRecord()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return fmt.Errorf("read records: %w", err)
			}
			m, err := f.message(rec, res.HighWatermark)
			if err != nil {
				return err
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
				return err
			}
			f.offset = m.Offset + 1
		}
	}
	return nil
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
