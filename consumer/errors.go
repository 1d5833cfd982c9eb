package consumer

import (
	"errors"
	"fmt"
)

// PermanentError marks a handler error that retrying cannot fix. Build it
// with Permanent.
type PermanentError struct {
	Err error
}

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err so the Processor skips its retries: the message is
// dead-lettered after this one attempt. Permanent(nil) returns nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err was marked with Permanent.
func IsPermanent(err error) bool {
	var pe *PermanentError
	return errors.As(err, &pe)
}

// PanicError is the error of a handler that panicked. The Processor
// recovers the panic, logs Stack and retries like any other error.
type PanicError struct {
	Value any
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("handler panicked: %v", e.Value) }

// ErrDeadLetterTopicMissing is wrapped by a Transport's PublishDeadLetter
// error when the broker says the dead-letter topic does not exist. onceflow
// never creates topics: create "<topic>.dlq" beside every consumed topic
// (or whatever Config.DeadLetterTopic names). Until it exists, the message's
// partition waits: every failed publish is logged at Error and reported to
// HookDeadLetterFailed, and the adapters' StopOnMissingDeadLetterTopic makes
// Run return an error wrapping this instead.
var ErrDeadLetterTopicMissing = errors.New("dead-letter topic does not exist")

// ErrDeadLetterTooLarge is wrapped by a Transport's PublishDeadLetter error
// when the client or the broker refuses the dead letter for its size (the
// dead-letter topic's max.message.bytes, or the headers added to a record
// near the limit). The Processor then publishes it without the original's
// value (HeaderDLQValueOmitted), and, still too large, without the
// original's headers but a usable message id, then with a key longer than
// 64 bytes replaced by its SHA-256 in hex (never null: a compacted topic
// refuses a record without a key), then with its HeaderDLQError cut to 256
// bytes, rather than stop the partition for good.
var ErrDeadLetterTooLarge = errors.New("dead letter too large for its topic")
