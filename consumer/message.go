package consumer

import (
	"errors"
	"fmt"
	"time"
	"unicode/utf8"
)

// MessageIDHeader is the record header the relay sets on every event: the
// default source of a message's id.
const MessageIDHeader = "message-id"

// maxMessageIDLen bounds ids so a corrupt header cannot bloat the dedup index.
const maxMessageIDLen = 512

// Header is one record header.
type Header struct {
	Key   string
	Value []byte
}

// Message is one Kafka record, as adapters hand it to the core.
type Message struct {
	Topic     string
	Partition int32
	Offset    int64
	Key       []byte
	Value     []byte
	Headers   []Header
	Timestamp time.Time
	// ID is the id the message is deduplicated on, filled in by the
	// Processor (from Config.MessageID) before the handler sees the message.
	ID string
	// Raw is the adapter's own record (*kgo.Record, kafka.Message), for
	// handlers that need more than the fields above. Treat it as read-only.
	Raw any

	// skip marks a record that only advances the offset (a transaction
	// marker); see Partition.AddSkip.
	skip bool
}

// Header returns the value of the last header named key, and whether there
// was one.
func (m Message) Header(key string) ([]byte, bool) {
	for i := len(m.Headers) - 1; i >= 0; i-- {
		if m.Headers[i].Key == key {
			return m.Headers[i].Value, true
		}
	}
	return nil, false
}

// ErrNoMessageID is wrapped by the error of a message whose id is missing or
// unusable. Such a message is dead-lettered at once, without retries.
var ErrNoMessageID = errors.New("no usable message id")

// HeaderMessageID is the default Config.MessageID: the value of the
// message-id header, which must be non-empty valid UTF-8 without NUL bytes
// and at most 512 bytes long.
func HeaderMessageID(m Message) (string, error) {
	v, ok := m.Header(MessageIDHeader)
	if !ok {
		return "", fmt.Errorf("%w: header %q is missing", ErrNoMessageID, MessageIDHeader)
	}
	return checkID(string(v))
}

func checkID(id string) (string, error) {
	switch {
	case id == "":
		return "", fmt.Errorf("%w: id is empty", ErrNoMessageID)
	case len(id) > maxMessageIDLen:
		return "", fmt.Errorf("%w: id is %d bytes long, more than %d", ErrNoMessageID, len(id), maxMessageIDLen)
	case !utf8.ValidString(id):
		return "", fmt.Errorf("%w: id is not valid UTF-8", ErrNoMessageID)
	}
	for i := 0; i < len(id); i++ {
		if id[i] == 0 {
			return "", fmt.Errorf("%w: id holds a NUL byte", ErrNoMessageID)
		}
	}
	return id, nil
}
