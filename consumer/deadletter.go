package consumer

import (
	"context"
	"errors"
	"log/slog"
	"time"
)

// Headers added to every dead-letter record, beside the original headers
// (message-id included), key and value.
const (
	// HeaderDLQError holds the last error's text.
	HeaderDLQError = "onceflow-error"
	// HeaderDLQAttempts holds how many times the handler ran (0 when the
	// message had no usable id).
	HeaderDLQAttempts = "onceflow-attempts"
	// HeaderDLQConsumer holds the consumer name.
	HeaderDLQConsumer = "onceflow-consumer"
	// HeaderDLQTopic, HeaderDLQPartition and HeaderDLQOffset locate the
	// original record.
	HeaderDLQTopic     = "onceflow-origin-topic"
	HeaderDLQPartition = "onceflow-origin-partition"
	HeaderDLQOffset    = "onceflow-origin-offset"
	// HeaderDLQTime holds when the message was dead-lettered (RFC 3339).
	HeaderDLQTime = "onceflow-dead-at"
)

// DeadLetter is a record for the dead-letter topic, built by the Processor
// and published by the adapter's Transport.
type DeadLetter struct {
	// Topic is the dead-letter topic (Config.DeadLetterTopic).
	Topic   string
	Key     []byte
	Value   []byte
	Headers []Header
	// Message is the original message; Err and Attempts why and after how
	// many attempts it failed.
	Message  Message
	Err      error
	Attempts int
}

func (p *Processor) newDeadLetter(msg Message, attempts int, err error) DeadLetter {
	hs := make([]Header, 0, len(msg.Headers)+7)
	for _, h := range msg.Headers {
		switch h.Key {
		case HeaderDLQError, HeaderDLQAttempts, HeaderDLQConsumer, HeaderDLQTopic, HeaderDLQPartition, HeaderDLQOffset, HeaderDLQTime:
			// A message dead-lettered twice (replayed from a DLQ) reports
			// its latest failure only.
			continue
		}
		hs = append(hs, h)
	}
	hs = append(hs,
		Header{HeaderDLQError, []byte(err.Error())},
		Header{HeaderDLQAttempts, itoa(int64(attempts))},
		Header{HeaderDLQConsumer, []byte(p.name)},
		Header{HeaderDLQTopic, []byte(msg.Topic)},
		Header{HeaderDLQPartition, itoa(int64(msg.Partition))},
		Header{HeaderDLQOffset, itoa(msg.Offset)},
		Header{HeaderDLQTime, []byte(time.Now().UTC().Format(time.RFC3339Nano))},
	)
	return DeadLetter{
		Topic:    p.cfg.DeadLetterTopic(msg),
		Key:      msg.Key,
		Value:    msg.Value,
		Headers:  hs,
		Message:  msg,
		Err:      err,
		Attempts: attempts,
	}
}

// deadLetter publishes msg to the dead-letter topic, retrying the publish
// until the broker acknowledges it: a message is never dropped silently. It
// returns errAbandoned when ctx or stop ends first.
func (p *Processor) deadLetter(ctx context.Context, stop <-chan struct{}, msg Message, attempts int, cause error, t Transport) error {
	rec := p.newDeadLetter(msg, attempts, cause)
	p.log.LogAttrs(ctx, slog.LevelError, "consumer: dead-lettering message",
		slog.String("topic", msg.Topic), slog.Int("partition", int(msg.Partition)), slog.Int64("offset", msg.Offset),
		slog.String("message_id", msg.ID), slog.Int("attempts", attempts), slog.String("dlq", rec.Topic), slog.Any("error", cause))
	bo := p.newBackoff()
	for {
		err := t.PublishDeadLetter(ctx, rec)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return errAbandoned
		}
		wait := bo.NextBackOff()
		missing := errors.Is(err, ErrDeadLetterTopicMissing)
		if missing {
			// Loud: the partition stays stalled until an operator acts.
			p.log.LogAttrs(ctx, slog.LevelError, "consumer: dead-letter topic does not exist; the partition waits until it is created",
				slog.String("dlq", rec.Topic), slog.String("topic", msg.Topic), slog.Int("partition", int(msg.Partition)),
				slog.Int64("offset", msg.Offset), slog.Duration("backoff", wait), slog.Any("error", err))
		} else {
			p.log.LogAttrs(ctx, slog.LevelWarn, "consumer: dead-letter publish failed; retrying",
				slog.String("dlq", rec.Topic), slog.Int64("offset", msg.Offset), slog.Duration("backoff", wait), slog.Any("error", err))
		}
		for _, h := range p.hooks.dlqF {
			h.OnDeadLetterFailed(DeadLetterFailedEvent{Consumer: p.name, Message: msg, Topic: rec.Topic, Err: err, TopicMissing: missing, Backoff: wait})
		}
		if !sleep(ctx, stop, wait) {
			return errAbandoned
		}
	}
	for _, h := range p.hooks.dead {
		h.OnDeadLetter(DeadLetterEvent{Consumer: p.name, Message: msg, Topic: rec.Topic, Attempts: attempts, Err: cause})
	}
	if len(p.hooks.trace) > 0 {
		p.traceDeadLetter(ctx, cause, rec.Topic)
	}
	p.finished(ctx, msg, DeadLettered, attempts, 0, 1, false)
	return nil
}
