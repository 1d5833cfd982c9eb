package consumer

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/onceflow/onceflow/migrations"
)

// Config configures a Processor. The zero value is usable; a nil *Config is
// the zero value.
type Config struct {
	// Schema holds the processed_messages table. Defaults to "onceflow".
	Schema string

	// MessageID derives the id a message is deduplicated on. Return an error
	// wrapping ErrNoMessageID (or any error) when the message has no usable
	// id: it is dead-lettered with that reason, without retries. Derive it
	// from a business key when producers may re-publish an event under a new
	// message-id. The id is deduplicated per consumer name, not per topic:
	// a Processor reading several topics whose ids may repeat across them
	// (a business key used on each) should put the topic in the id, or run
	// one Processor name per topic. (An outbox event fanned out to several
	// topics keeps one message-id: read by one Processor, it runs once.)
	// Defaults to HeaderMessageID (the "message-id" header).
	MessageID func(Message) (string, error)

	// MaxAttempts is the retry budget: how many times the handler runs for
	// one message before it is dead-lettered. Defaults to 5.
	MaxAttempts int
	// MaxLostConnections is the budget, apart from MaxAttempts, for
	// attempts whose database connection was lost after the message's
	// transaction began: the server ended the session while the handler
	// ran or at COMMIT (idle_in_transaction_session_timeout,
	// transaction_timeout, pg_terminate_backend, a backend crash, a
	// restart or failover), or the handler's own context deadline closed
	// it. Such a loss may be the message's doing, so it is not waited out
	// like an outage (failing to acquire a connection or to begin); it is
	// counted apart so that a database restart costs a message in flight
	// one of these, not one of its attempts. Once spent, the message is
	// dead-lettered. After a COMMIT whose outcome is unknown, the
	// Processor first looks at the dedup record: a message whose COMMIT
	// went through is never dead-lettered. Defaults to 3.
	MaxLostConnections int
	// MaxConflicts is the budget, apart from MaxAttempts, for attempts
	// PostgreSQL rolled back with a serialization failure (SQLSTATE 40001)
	// or a deadlock (40P01), from a handler's statement or at COMMIT:
	// PostgreSQL's answer to both is to retry the transaction, and under
	// REPEATABLE READ or SERIALIZABLE (a role's or the pool's
	// default_transaction_isolation) valid messages meet them whenever
	// handlers contend for rows. They are retried with the same backoff,
	// logged at Warn as conflicts and reported with RetryEvent.Conflict
	// set. In batch mode a conflicting batch is retried whole, spending
	// this budget, before it is split. Once spent, further conflicts
	// count as handler failures, so a message that conflicts for good is
	// still dead-lettered (G6). An error the handler wraps in Permanent is
	// not retried. Lock timeouts (55P03) and statement timeouts (57014)
	// are handler failures: they end waits that were bounded on purpose.
	// Defaults to 50.
	MaxConflicts int
	// MinBackoff is the wait after the first failed attempt; later waits
	// grow exponentially with jitter. Defaults to 100ms.
	MinBackoff time.Duration
	// MaxBackoff caps the wait between attempts. Defaults to 10s.
	MaxBackoff time.Duration

	// DeadLetterTopic names the topic a failed message goes to. Defaults to
	// the message's topic with ".dlq" appended.
	DeadLetterTopic func(Message) string

	// Concurrency is how many messages of one partition are processed at
	// once, in per-message mode. Messages with the same key always run one
	// at a time and in offset order; keyless messages are spread freely.
	// Offsets are committed only below the lowest unfinished message.
	// Ignored in batch mode. Defaults to 1: strict partition order.
	Concurrency int

	// BatchSize is the most messages one batch-mode transaction takes; a
	// batch holds what is already buffered, it never waits to fill up.
	// Ignored in per-message mode. Defaults to 500.
	BatchSize int

	// QueueSize is how many fetched messages each partition buffers ahead
	// of processing; adapters block fetching when it is full (see
	// QueueBytes for what it costs in memory). Defaults to 1024.
	QueueSize int
	// QueueBytes bounds the bytes (keys, values and headers) of the
	// messages each partition buffers ahead of processing; adapters block
	// fetching the partition when QueueSize or QueueBytes is reached,
	// whichever comes first. A message larger than the room left is taken
	// alone once nothing else waits (in key-parallel mode, nothing but
	// messages parked behind busy keys, holding under QueueBytes), so it
	// is processed, never stuck.
	// Memory: a worker buffers up to assigned partitions × QueueBytes
	// (4 MiB × 64 partitions is 256 MiB), on top of the messages in
	// process (one per partition, up to Concurrency in key-parallel mode,
	// a batch of about QueueBytes at most in batch mode) and of what the
	// client library fetched and holds (franz-go's FetchMaxBytes,
	// kafka-go's Reader.MaxBytes per partition). At the defaults,
	// messages of up to 4 KiB are bounded by QueueSize first. Defaults to
	// 4 MiB.
	QueueBytes int64

	// PlainBegin makes each per-message transaction start with BEGIN and
	// then INSERT … ON CONFLICT DO NOTHING, two round trips, and end with
	// a COMMIT of its own. Otherwise, with a *pgxpool.Pool, BEGIN and the
	// dedup insert go in one simple-protocol query that EXECUTEs a
	// per-connection prepared statement, a message's COMMIT carries the
	// next queued message's BEGIN and dedup insert, and a duplicate shows
	// in the server log as a duplicate-key ERROR. Set it behind PgBouncer
	// in transaction mode (before 1.21, prepared statements stay on the
	// server connection that prepared them, and the pooler lends each
	// transaction another) or when those log lines are unwelcome. Unset
	// there, the Processor notices the first time its statement is
	// missing on the server session (or already on it), logs a Warn
	// once, and behaves as if it were set from then on. Defaults to false.
	PlainBegin bool

	// Hooks receive metrics events; see Hook. Defaults to none.
	Hooks []Hook

	// Logger receives retries (Warn), dead letters and panics (Error).
	// Defaults to slog.Default(): a partition waiting on a missing
	// dead-letter topic or a missing grant must be heard.
	Logger *slog.Logger
}

func (c *Config) withDefaults() (Config, error) {
	var out Config
	if c != nil {
		out = *c
	}
	if out.Schema == "" {
		out.Schema = migrations.DefaultSchema
	}
	if out.MessageID == nil {
		out.MessageID = HeaderMessageID
	}
	if out.MaxAttempts == 0 {
		out.MaxAttempts = 5
	}
	if out.MaxLostConnections == 0 {
		out.MaxLostConnections = 3
	}
	if out.MaxConflicts == 0 {
		out.MaxConflicts = 50
	}
	if out.MinBackoff == 0 {
		out.MinBackoff = 100 * time.Millisecond
	}
	if out.MaxBackoff == 0 {
		out.MaxBackoff = 10 * time.Second
	}
	if out.DeadLetterTopic == nil {
		out.DeadLetterTopic = func(m Message) string { return m.Topic + ".dlq" }
	}
	if out.Concurrency == 0 {
		out.Concurrency = 1
	}
	if out.BatchSize == 0 {
		out.BatchSize = 500
	}
	if out.QueueSize == 0 {
		out.QueueSize = 1024
	}
	if out.QueueBytes == 0 {
		out.QueueBytes = 4 << 20
	}
	if out.Logger == nil {
		out.Logger = slog.Default()
	}

	if err := migrations.ValidateSchema(out.Schema); err != nil {
		return out, fmt.Errorf("consumer: Config.Schema: %w", err)
	}
	switch {
	case out.MaxAttempts < 1:
		return out, errors.New("consumer: Config.MaxAttempts must be at least 1")
	case out.MaxLostConnections < 1:
		return out, errors.New("consumer: Config.MaxLostConnections must be at least 1")
	case out.MaxConflicts < 1:
		return out, errors.New("consumer: Config.MaxConflicts must be at least 1")
	case out.MinBackoff < 0:
		return out, errors.New("consumer: Config.MinBackoff must not be negative")
	case out.MaxBackoff < out.MinBackoff:
		return out, errors.New("consumer: Config.MaxBackoff must not be below MinBackoff")
	case out.Concurrency < 1:
		return out, errors.New("consumer: Config.Concurrency must be at least 1")
	case out.BatchSize < 1:
		return out, errors.New("consumer: Config.BatchSize must be at least 1")
	case out.QueueSize < 1:
		return out, errors.New("consumer: Config.QueueSize must be at least 1")
	case out.QueueBytes < 1:
		return out, errors.New("consumer: Config.QueueBytes must be at least 1")
	}
	return out, nil
}
