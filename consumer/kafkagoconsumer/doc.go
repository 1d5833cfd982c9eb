// Package kafkagoconsumer runs a consumer.Processor over a
// segmentio/kafka-go Reader in a consumer group.
//
//	p, err := consumer.New(pool, "ledger", handle, nil)
//	c, err := kafkagoconsumer.New(p, &kafkagoconsumer.Config{Reader: kafka.ReaderConfig{
//		Brokers:     []string{"localhost:9092"},
//		GroupTopics: []string{"payments"},
//	}})
//	err = c.Run(ctx) // until ctx is canceled
//
// Offsets of finished messages (committed transaction, duplicate or dead
// letter) are committed with Reader.CommitMessages every CommitInterval and
// at shutdown; the Reader's own CommitInterval is not used.
//
// Limits of kafka-go, and what the adapter does about them:
//
//   - The Reader hands transaction control records (commit and abort
//     markers) to the application. The adapter recognises them by shape
//     (IsControlRecord) and only advances the offset past them.
//   - The Reader ignores read_committed: records of aborted transactions
//     reach the handler. Use kgoconsumer for topics written by
//     transactional producers that abort. onceflow's relay does not use
//     transactions.
//   - The Reader has no revocation callback. After a rebalance, messages
//     of a partition that moved may still finish here and their offsets be
//     committed late. That can only move a committed offset back, which
//     causes redeliveries, and those are skipped as duplicates.
//   - One fetch loop serves every partition: a partition whose queue is
//     full (a slow handler, retries) holds up fetching for the others.
//
// The default dead-letter Writer uses RequiredAcks all, murmur2
// partitioning and a 5ms BatchTimeout; kafka-go's defaults (no acks, 1s)
// would lose dead letters or stall the partition.
package kafkagoconsumer
