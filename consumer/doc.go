// Package consumer makes Kafka consumers idempotent on PostgreSQL: a
// handler's database effects commit at most once per (consumer name,
// message id), and at least once per delivered message, however often the
// message is delivered (G5).
//
// For every message the Processor begins a transaction, records the message
// id with
//
//	INSERT INTO onceflow.processed_messages (consumer, message_id) VALUES ($1, $2)
//
// (sent with BEGIN in one round trip, a row already there failing on the
// primary key; with Config.PlainBegin, a Beginner that is not a pool, or in
// batch mode, with ON CONFLICT DO NOTHING and the rows it inserted telling)
// and, if the row is new, runs your handler with that same transaction and
// commits. If the row already exists the message is a duplicate: nothing
// runs and nothing commits. Only after the commit is the offset marked for
// commit in Kafka, so a crash at any instant either leaves nothing (the
// message is processed on redelivery) or leaves the record (the redelivered
// message is skipped). That needs a durable COMMIT: a session with
// synchronous_commit off has it raised to on for the Processor's
// transactions, by the dedup insert itself. A concurrent duplicate, say the same message in two
// processes at once, blocks on the primary key until the first transaction
// ends, then sees the row and skips.
//
// Adapters run a Processor over a consumer group: kgoconsumer (franz-go)
// and kafkagoconsumer (segmentio/kafka-go).
//
//	p, err := consumer.New(pool, "ledger", func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
//		tag, err := tx.Exec(ctx, `UPDATE accounts SET balance = balance + $1 WHERE id = $2`, amount, account)
//		if err == nil && tag.RowsAffected() == 0 {
//			// Not nil: nil records the message as processed, for good.
//			err = consumer.Permanent(fmt.Errorf("no account %s", account))
//		}
//		return err
//	}, nil)
//	if err != nil {
//		return err
//	}
//	c, err := kgoconsumer.New(p, &kgoconsumer.Config{Brokers: brokers, Topics: []string{"payments"}})
//	if err != nil {
//		return err
//	}
//	return c.Run(ctx) // until ctx is canceled
//
// # Message ids
//
// The id comes from the "message-id" header that onceflow's relay sets on
// every event (a UUID, stable across re-sends). Config.MessageID can derive
// it otherwise, from a business key for instance. A message without a
// usable id is dead-lettered with the reason; it never crashes the consumer
// and is never skipped silently. So is one whose id the database's
// encoding cannot hold (SQLSTATE 22P05, with client_encoding UTF8 on a
// LATIN1 database, say): at once, not waited out as an outage. Such an id
// (any id outside ASCII) begins its transaction by itself rather than in
// the round trip of the previous message's COMMIT, which the server would
// refuse whole.
//
// # Failures and dead letters (G6)
//
// A handler error (or panic, which is recovered and logged with its stack)
// rolls the transaction back, dedup record included, and the message is
// retried with exponential backoff up to Config.MaxAttempts. Permanent(err)
// skips the retries. After the budget the message is published to the
// dead-letter topic (default "<topic>.dlq") with its key, value and
// headers plus onceflow-error, onceflow-attempts, onceflow-consumer and
// onceflow-origin-topic/-partition/-offset, and the partition moves on.
// The dead letter of a tombstone has an empty value (a null one would be a
// tombstone on a compacted dead-letter topic) and onceflow-tombstone: true
// (HeaderDLQTombstone): a replay must send null where it says so.
// The dead-letter publish itself is retried until the broker acknowledges
// it: a message is never dropped. onceflow never creates topics: create the
// dead-letter topic beside each consumed topic. While it is missing, the
// partition waits, loudly: each failed publish is logged at Error and
// reported to HookDeadLetterFailed (consumerprom counts it as
// onceflow_consumer_dead_letter_failures_total{reason="topic-missing"}), and
// the adapters' StopOnMissingDeadLetterTopic makes Run return an error
// wrapping ErrDeadLetterTopicMissing instead. Database outages (no connection can be
// acquired, or the transaction cannot begin) are waited out with backoff
// and never spend a budget, so an outage does not dead-letter messages. A
// serialization failure (SQLSTATE 40001) or deadlock (40P01), which
// PostgreSQL answers with "retry the transaction", spends
// Config.MaxConflicts (default 50), not MaxAttempts: valid messages meet
// them under REPEATABLE READ or SERIALIZABLE whenever handlers contend for
// rows. They are retried with backoff (a batch whole), logged as such and
// reported with RetryEvent.Conflict; past that budget they count as
// handler failures. Lock and statement timeouts are handler failures. A
// connection lost after the transaction began (the server ended the
// session while the handler ran or at COMMIT: idle_in_transaction_session_timeout,
// transaction_timeout, pg_terminate_backend, a crashing backend, a restart)
// may be the message's own doing, so it spends a budget of its own,
// Config.MaxLostConnections (default 3), apart from MaxAttempts: a restart
// costs a message in flight one of those, and a message whose handler
// keeps losing its connection is dead-lettered instead of blocking its
// partition. When a COMMIT's outcome is unknown, the dedup record is
// checked before the message is dead-lettered.
//
// # Modes
//
//   - In order (default): one message at a time per partition.
//   - Key-parallel (Config.Concurrency > 1): messages of one partition run
//     concurrently across keys, each key in offset order; offsets are
//     committed only below the lowest unfinished message.
//   - Batch (NewBatch): one transaction and one multi-row dedup insert per
//     batch; the BatchHandler sees only the new messages. A failing batch
//     is retried one message per transaction, so only the poison message
//     is dead-lettered (a batch rolled back for a serialization failure or
//     deadlock is first retried whole). This is the throughput mode.
//
// # Rebalances and shutdown
//
// Offsets are committed only after the database commit. When partitions are
// revoked or the consumer stops, messages not yet started are dropped
// (they will be delivered again), retries waiting for their backoff are
// abandoned, and transactions in flight get a grace period to finish: the
// adapters' RevokeGrace at a rebalance (default 1s, at most a quarter of
// the group's rebalance timeout, so the member rejoins before the group
// evicts it) and ShutdownGrace at shutdown (default 5s). Then the handler's
// ctx is canceled and its transaction rolls back: nothing of it commits,
// its offset is not committed, and the message is processed by the
// partition's next owner, once (the dedup record). A handler stuck on a
// slow call or a lock thus holds a rebalance up for the grace, not until it
// returns. A handler that ignores its canceled ctx is abandoned half a
// second later, with an Error log: it runs on, but its COMMIT is sent with
// the canceled ctx, so it cannot commit, and it marks nothing done; its
// connection is closed, so the server rolls its transaction back at once and
// the message delivered again does not wait for it (see Partition.Stop).
//
// # Retention
//
// Dedup records are kept for a window (default 15 days) and then deleted in
// small batches by a Janitor. The window must exceed the longest
// redelivery horizon: how long the topic can keep a record (retention.ms
// plus segment.ms: a group that lost its offsets or was reset to the
// earliest re-reads all of it), producer re-sends, how long an offset can
// stay behind messages already processed, and consumer downtime (see
// JanitorConfig.Window). A message delivered again after its record expired
// is processed again. A janitor sweeps every consumer of its schema, and the
// janitors on a schema keep records for the longest window among them.
//
// # Side effects outside the database
//
// Only effects written through tx are covered. An HTTP call or an e-mail
// made by the handler can happen twice (the transaction may roll back after
// the call, and the message is retried). Guard those with the run-once fence
// in package idempotency (idempotency.Do, given the pool and not tx, whose
// rollback would undo the claim), keyed by the consumer name, the effect
// and the message id, and pass that key on so the remote service can
// deduplicate too.
//
// # Concurrency
//
// A Processor is safe for concurrent use; handlers run concurrently for
// different partitions (and keys, in key-parallel mode), so a Handler must
// be too. Hooks (Config.Hooks) are called synchronously and must be cheap;
// package consumerprom turns them into Prometheus metrics. A HookTrace
// (otelonceflow.NewConsumer) wraps each message in a span joined to its
// producer's trace; the handler's ctx holds it. In batch mode each
// message's span covers the batch's transaction, and the BatchHandler's ctx
// holds none of them (a batch's messages belong to many traces).
package consumer
