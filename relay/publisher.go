package relay

import (
	"context"
	"errors"
)

// Record is one outbox event as it goes to Kafka.
type Record struct {
	Topic   string
	Key     []byte // nil: no key
	Value   []byte // nil: null value
	Headers []Header
}

// Header is a Kafka record header.
type Header struct {
	Key   string
	Value []byte
}

// Publisher sends records to Kafka and waits for the broker's
// acknowledgement (acks=all) of each.
//
// Publish returns one error per record, in the records' order: nil means
// the record was acknowledged. Records with the same key must be sent in
// slice order and land in one partition (murmur2, as the Java client does).
// Once a record fails, refused for good included, its key's later records
// in the call must not be acknowledged: fail them unsent, wrapping
// ErrNotSent (relaytest.RunPublisherConformance checks both).
// A publisher marks refusals by wrapping ErrRecordTooLarge, ErrTopicInvalid,
// ErrTopicForbidden, ErrRecordInvalid or ErrUnknownTopic; any other error is taken as passing
// (a broker outage) and the record is retried. Publish must return when ctx
// is done, failing what was not acknowledged: the relay bounds each call
// with Config.PublishTimeout this way.
//
// The relay calls Publish from two goroutines at most: its rounds, and the
// retry of records that were not acknowledged in time (never with records
// of a key the other call holds). Publish must be safe for that.
type Publisher interface {
	Publish(ctx context.Context, records []Record) []error
	Close() error
}

// PartitionReporter is an optional interface of a Publisher: it tells which
// partition a keyed record goes to, from what the publisher already knows
// (its partitioner and its cached partition count of the topic), without
// I/O. Both publishers of this module implement it.
//
// The relay uses it to learn a sick partition once rather than one key at a
// time: once a record was not acknowledged within Config.PublishTimeout, the
// relay stops sending new keys of its partition in the rounds and lets one
// probe at a time retry it beside them (see Config.PublishTimeout). A wrong
// answer (a partition count changed since the publisher's last look) costs
// only time, never order.
//
// ok is false when the publisher cannot tell: the topic's partition count is
// not known yet, or the record has no key and the partitioner places it as
// it goes. Partition must be safe for concurrent use. A Publisher that wraps
// another (to time or trace its calls) should pass Partition through: the
// relay finds it by a type assertion on the Publisher it is given.
type PartitionReporter interface {
	Partition(topic string, key []byte) (partition int32, ok bool)
}

// Refusals a Publisher reports by wrapping these with errors.Join or %w.
var (
	// ErrRecordTooLarge: the client or the broker refused the record's size.
	// The relay publishes the record alone to be sure it is the offender,
	// then dead-letters it.
	ErrRecordTooLarge = errors.New("record too large")
	// ErrTopicForbidden: not authorized for the topic. An ACL being
	// granted or an authorizer restarting is routine: the relay retries it
	// for Config.TopicForbiddenGrace of unbroken refusals, then
	// dead-letters the event.
	ErrTopicForbidden = errors.New("topic forbidden")
	// ErrTopicInvalid: the topic's name is not a valid Kafka topic name.
	// Dead-lettered at once.
	ErrTopicInvalid = errors.New("invalid topic name")
	// ErrUnknownTopic: the topic does not exist. Kafka calls this retriable,
	// since auto-creation may be under way: the relay retries it for
	// Config.UnknownTopicGrace of unbroken unknown-topic answers, then
	// dead-letters the event.
	ErrUnknownTopic = errors.New("unknown topic")
	// ErrRecordInvalid: the broker refused the record itself (e.g. a keyless
	// record on a compacted topic). Published alone to find the offender
	// (the broker fails the whole batch), then dead-lettered.
	ErrRecordInvalid = errors.New("record invalid")
	// ErrNotSent: the publisher did not send the record, to keep its key's
	// order: an earlier record of its key in the call failed, or may yet
	// be refused (one near the size limit). The relay reads it again in a
	// later round, uncharged and without backoff.
	ErrNotSent = errors.New("not sent")
)

// refusal classifies a publish error.
type refusal int

const (
	retriable refusal = iota
	tooLarge
	forbidden
	unknownTopic
	invalid
	topicInvalid
)

func classify(err error) refusal {
	switch {
	case errors.Is(err, ErrRecordTooLarge):
		return tooLarge
	case errors.Is(err, ErrTopicInvalid):
		return topicInvalid
	case errors.Is(err, ErrTopicForbidden):
		return forbidden
	case errors.Is(err, ErrRecordInvalid):
		return invalid
	case errors.Is(err, ErrUnknownTopic):
		return unknownTopic
	default:
		return retriable
	}
}
