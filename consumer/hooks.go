package consumer

import "time"

// Hook is any value implementing one or more of the Hook… interfaces below
// (franz-go's hook style). Hooks are called synchronously on the processing
// path: they must be cheap, safe for concurrent use, and must not keep the
// Message's slices.
type Hook any

// Outcome is how a message left the Processor.
type Outcome int

const (
	// Processed: the handler ran and its transaction committed.
	Processed Outcome = iota + 1
	// Duplicate: the message id was already recorded; the handler did not
	// run for this delivery. (A delivery whose own COMMIT lost its
	// connection yet went through is Processed: the retry finds the
	// record its handler's transaction committed.)
	Duplicate
	// DeadLettered: the message was published to the dead-letter topic.
	DeadLettered
)

func (o Outcome) String() string {
	switch o {
	case Processed:
		return "processed"
	case Duplicate:
		return "duplicate"
	case DeadLettered:
		return "dead-lettered"
	}
	return "unknown"
}

// DoneEvent reports a message that is finished: committed, skipped or
// dead-lettered. Its offset is marked for commit right after the hooks
// return.
type DoneEvent struct {
	Consumer string
	Message  Message
	Outcome  Outcome
	// Attempts is how many times the handler ran (0 for a duplicate).
	Attempts int
	// Retries is how many failed attempts were retried (the HookRetry
	// calls for it), those that failed before the handler ran or at
	// COMMIT included. A message whose COMMIT lost its connection and
	// went through anyway is Processed, one Attempt, one Retry: the retry
	// found its dedup record, the effect of this very delivery.
	Retries int
	// Duration is the last attempt's time in the database transaction
	// (begin to commit), the handler latency as seen by the database.
	Duration time.Duration
	// BatchSize is the size of the batch the message was processed in; 1
	// in per-message mode.
	BatchSize int
	// Batched is true when a batch transaction (batch mode) finished the
	// message, a batch of one included; HookBatch reports that
	// transaction, so Duration here is the batch's, not the message's own.
	// False for per-message transactions, the per-message runs after a
	// failed batch among them.
	Batched bool
}

// HookDone is called for every finished message.
type HookDone interface {
	OnDone(DoneEvent)
}

// RetryEvent reports a failed attempt that will be retried.
type RetryEvent struct {
	Consumer string
	Message  Message
	// Attempt is how many times the handler has run for the message so
	// far; an attempt that failed before the handler ran (the database
	// unavailable) does not count.
	Attempt int
	Err     error
	Backoff time.Duration
	// Conflict is set when Err is a serialization failure or a deadlock
	// (SQLSTATE 40001, 40P01): PostgreSQL rolled the transaction back for
	// it to be retried, and the retry spends Config.MaxConflicts, not
	// MaxAttempts, until that is spent. A batch retried whole after one
	// (batch mode) is reported once, with its first message, Attempt
	// counting the batch's conflicts.
	Conflict bool
}

// HookRetry is called after every failed attempt that will be retried: a
// handler error, a conflict (RetryEvent.Conflict), a connection lost in
// the transaction, and a database that could not be reached or begin the
// transaction (waited out without spending any budget).
type HookRetry interface {
	OnRetry(RetryEvent)
}

// DeadLetterEvent reports a message published to the dead-letter topic.
type DeadLetterEvent struct {
	Consumer string
	Message  Message
	Topic    string
	Attempts int
	Err      error
}

// HookDeadLetter is called after a dead-letter record was acknowledged.
type HookDeadLetter interface {
	OnDeadLetter(DeadLetterEvent)
}

// DeadLetterFailedEvent reports a dead-letter publish that failed and will
// be retried after Backoff; the message's partition waits meanwhile.
// TopicMissing is set when the broker said the topic does not exist (see
// ErrDeadLetterTopicMissing), which lasts until someone creates it;
// TooLarge when the dead letter is too large for its topic even after
// every shrinking step (see ErrDeadLetterTooLarge), which lasts until
// someone raises the topic's max.message.bytes.
type DeadLetterFailedEvent struct {
	Consumer     string
	Message      Message
	Topic        string
	Err          error
	TopicMissing bool
	TooLarge     bool
	Backoff      time.Duration
}

// HookDeadLetterFailed is called after every failed dead-letter publish
// that is retried after a backoff. A refusal for size that a smaller dead
// letter is sent for at once (see ErrDeadLetterTooLarge) is logged at
// Error instead; one with nothing left to drop is reported, TooLarge set.
type HookDeadLetterFailed interface {
	OnDeadLetterFailed(DeadLetterFailedEvent)
}

// BatchEvent reports a batch-mode transaction that ended well: committed,
// or rolled back because every message was a duplicate.
type BatchEvent struct {
	Consumer string
	// Size is the number of messages in the batch, New how many of them
	// the handler got.
	Size, New int
	// Duration is begin to commit.
	Duration time.Duration
}

// HookBatch is called once per batch transaction in batch mode.
type HookBatch interface {
	OnBatch(BatchEvent)
}

// hooks is the Config.Hooks sorted by interface, so the hot path does no
// type assertions.
type hooks struct {
	done  []HookDone
	retry []HookRetry
	dead  []HookDeadLetter
	dlqF  []HookDeadLetterFailed
	batch []HookBatch
	trace []HookTrace
}

func newHooks(hs []Hook) hooks {
	var h hooks
	for _, x := range hs {
		if d, ok := x.(HookDone); ok {
			h.done = append(h.done, d)
		}
		if r, ok := x.(HookRetry); ok {
			h.retry = append(h.retry, r)
		}
		if d, ok := x.(HookDeadLetter); ok {
			h.dead = append(h.dead, d)
		}
		if f, ok := x.(HookDeadLetterFailed); ok {
			h.dlqF = append(h.dlqF, f)
		}
		if b, ok := x.(HookBatch); ok {
			h.batch = append(h.batch, b)
		}
		if t, ok := x.(HookTrace); ok {
			h.trace = append(h.trace, t)
		}
	}
	return h
}
