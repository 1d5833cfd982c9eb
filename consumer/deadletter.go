package consumer

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"log/slog"
	"runtime/debug"
	"slices"
	"strings"
	"time"
)

// Headers added to every dead-letter record, beside the original headers
// (message-id included), key and value.
const (
	// HeaderDLQError holds the last error's text (its first 8 KiB).
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
	// HeaderDLQValueOmitted is set on a dead letter too large for its
	// topic, published without the original's value: it holds the value's
	// size in bytes. The origin headers say where the original lies.
	HeaderDLQValueOmitted = "onceflow-value-omitted"
	// HeaderDLQTombstone is "true" on the dead letter of a tombstone (a
	// record with a null value), and of a record that carried it (such a
	// dead letter replayed as it is). The dead letter's value is empty, not
	// null: on a compacted dead-letter topic a null value is a tombstone,
	// which compaction removes after delete.retention.ms, taking the key's
	// last dead letter with it. A tool replaying dead letters restores
	// null where this header says so.
	HeaderDLQTombstone = "onceflow-tombstone"
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
	hs := make([]Header, 0, len(msg.Headers)+8)
	tombstone := msg.Value == nil
	for _, h := range msg.Headers {
		if h.Key == HeaderDLQTombstone {
			// A fact about the original record, not about a failure: a
			// dead letter of a tombstone replayed as it is keeps it.
			tombstone = true
			continue
		}
		if slices.Contains(deadLetterHeaders, h.Key) {
			// A message dead-lettered twice (replayed from a DLQ) reports
			// its latest failure only.
			continue
		}
		hs = append(hs, h)
	}
	hs = append(hs,
		Header{HeaderDLQError, []byte(errorText(err))},
		Header{HeaderDLQAttempts, itoa(int64(attempts))},
		Header{HeaderDLQConsumer, []byte(p.name)},
		Header{HeaderDLQTopic, []byte(msg.Topic)},
		Header{HeaderDLQPartition, itoa(int64(msg.Partition))},
		Header{HeaderDLQOffset, itoa(msg.Offset)},
		Header{HeaderDLQTime, []byte(time.Now().UTC().Format(time.RFC3339Nano))},
	)
	value := msg.Value
	if value == nil {
		value = []byte{}
	}
	if tombstone {
		hs = append(hs, Header{HeaderDLQTombstone, []byte("true")})
	}
	return DeadLetter{
		Topic:    p.deadLetterTopic(msg),
		Key:      msg.Key,
		Value:    value,
		Headers:  hs,
		Message:  msg,
		Err:      err,
		Attempts: attempts,
	}
}

// maxErrorHeader bounds HeaderDLQError: a handler's error may carry a
// whole payload, and a dead letter must fit its topic.
const maxErrorHeader = 8 << 10

func errorText(err error) string {
	s := err.Error()
	if len(s) <= maxErrorHeader {
		return s
	}
	return strings.ToValidUTF8(s[:maxErrorHeader], "") + "... (cut at 8 KiB)"
}

// shrinkDeadLetter returns d smaller, and what it left out: first the
// original's value (HeaderDLQValueOmitted holds its size), then the
// original's headers but a usable message id (one too long to use is what
// dead-lettered the message, and may be what does not fit), then its key
// if longer than 64 bytes (replaced by its SHA-256 in hex), then the error
// text past its first 256 bytes (once: a cut text is not cut again). ""
// when nothing is left to drop. A message near its topic's size limit
// gains the dead letter's headers, and a dead-letter topic may take less
// than the consumed one: blocking the partition until an operator noticed would
// break G6, and the origin headers say where the original still lies.
// The value left out is empty, not null: a null value is a tombstone,
// which a compacted topic deletes along with the key's earlier records.
func shrinkDeadLetter(d DeadLetter) (DeadLetter, string) {
	if len(d.Value) > 0 {
		d.Value = []byte{}
		d.Headers = append(slices.Clip(d.Headers), Header{HeaderDLQValueOmitted, itoa(int64(len(d.Message.Value)))})
		return d, "the original's value"
	}
	kept := make([]Header, 0, len(d.Headers))
	for _, h := range d.Headers {
		if h.Key == MessageIDHeader && len(h.Value) <= maxMessageIDLen || slices.Contains(deadLetterHeaders, h.Key) {
			kept = append(kept, h)
		}
	}
	if len(kept) < len(d.Headers) {
		d.Headers = kept
		return d, "the original's headers"
	}
	if len(d.Key) > hashedKeyLen {
		// Not null: a compacted topic refuses a record without a key.
		// The same key hashes alike, so compaction keeps its meaning.
		sum := sha256.Sum256(d.Key)
		d.Key = []byte(hex.EncodeToString(sum[:]))
		return d, "the original's key (its SHA-256 in hex instead)"
	}
	for i, h := range d.Headers {
		if h.Key == HeaderDLQError && len(h.Value) > shrunkErrorHeader+len(errorCutMark) {
			d.Headers = slices.Clone(d.Headers)
			d.Headers[i].Value = []byte(strings.ToValidUTF8(string(h.Value[:shrunkErrorHeader]), "") + errorCutMark)
			return d, "its error text past the first 256 bytes"
		}
	}
	return d, ""
}

// shrunkErrorHeader is what is kept of HeaderDLQError when the dead letter
// still does not fit its topic without the original's value, headers and
// key (an 8 KiB error against a small max.message.bytes).
const shrunkErrorHeader = 256

// hashedKeyLen is the length of the key shrinkDeadLetter puts in place of
// a longer one: a SHA-256 in hex.
const hashedKeyLen = 2 * sha256.Size

// errorCutMark ends an error text shrinkDeadLetter cut.
const errorCutMark = "... (cut to fit the topic)"

// deadLetterHeaders are the headers newDeadLetter and shrinkDeadLetter add.
var deadLetterHeaders = []string{HeaderDLQError, HeaderDLQAttempts, HeaderDLQConsumer, HeaderDLQTopic,
	HeaderDLQPartition, HeaderDLQOffset, HeaderDLQTime, HeaderDLQValueOmitted, HeaderDLQTombstone}

// deadLetterTopic is Config.DeadLetterTopic's answer for msg, or the
// default "<topic>.dlq" if it panics: the message must still go somewhere.
func (p *Processor) deadLetterTopic(msg Message) (topic string) {
	defer func() {
		if r := recover(); r != nil {
			topic = msg.Topic + ".dlq"
			p.log.Error("consumer: Config.DeadLetterTopic panicked; the message goes to the default dead-letter topic",
				"topic", msg.Topic, "partition", msg.Partition, "offset", msg.Offset, "dlq", topic, "panic", r, "stack", string(debug.Stack()))
		}
	}()
	return p.cfg.DeadLetterTopic(msg)
}

// deadLetter publishes msg to the dead-letter topic, retrying the publish
// until the broker acknowledges it: a message is never dropped silently. It
// returns errAbandoned when ctx or stop ends first.
func (p *Processor) deadLetter(ctx context.Context, stop <-chan struct{}, msg Message, attempts, retries int, cause error, t Transport) error {
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
		if errors.Is(err, ErrDeadLetterTooLarge) {
			if smaller, what := shrinkDeadLetter(rec); what != "" {
				p.log.LogAttrs(ctx, slog.LevelError, "consumer: dead letter too large for its topic; publishing it without "+what,
					slog.String("dlq", rec.Topic), slog.String("topic", msg.Topic), slog.Int("partition", int(msg.Partition)),
					slog.Int64("offset", msg.Offset), slog.String("message_id", msg.ID), slog.Int("value_bytes", len(msg.Value)), slog.Any("error", err))
				rec = smaller
				continue
			}
		}
		wait := bo.NextBackOff()
		missing := errors.Is(err, ErrDeadLetterTopicMissing)
		tooLarge := errors.Is(err, ErrDeadLetterTooLarge) // and nothing left to drop
		switch {
		case tooLarge:
			// Nothing left to drop: only an operator (a larger
			// max.message.bytes) moves the partition on.
			p.log.LogAttrs(ctx, slog.LevelError, "consumer: dead letter too large for its topic even at its smallest; the partition waits until the topic's max.message.bytes is raised",
				slog.String("dlq", rec.Topic), slog.String("topic", msg.Topic), slog.Int("partition", int(msg.Partition)),
				slog.Int64("offset", msg.Offset), slog.Duration("backoff", wait), slog.Any("error", err))
		case missing:
			// Loud: the partition stays stalled until an operator acts.
			p.log.LogAttrs(ctx, slog.LevelError, "consumer: dead-letter topic does not exist; the partition waits until it is created",
				slog.String("dlq", rec.Topic), slog.String("topic", msg.Topic), slog.Int("partition", int(msg.Partition)),
				slog.Int64("offset", msg.Offset), slog.Duration("backoff", wait), slog.Any("error", err))
		default:
			p.log.LogAttrs(ctx, slog.LevelWarn, "consumer: dead-letter publish failed; retrying",
				slog.String("dlq", rec.Topic), slog.Int64("offset", msg.Offset), slog.Duration("backoff", wait), slog.Any("error", err))
		}
		for _, h := range p.hooks.dlqF {
			h.OnDeadLetterFailed(DeadLetterFailedEvent{Consumer: p.name, Message: msg, Topic: rec.Topic, Err: err, TopicMissing: missing, TooLarge: tooLarge, Backoff: wait})
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
	p.finished(ctx, msg, DeadLettered, attempts, retries, 0, 1, false)
	return nil
}
