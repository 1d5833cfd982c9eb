// Package kafkagoconsumer runs a consumer.Processor in a Kafka consumer
// group over segmentio/kafka-go.
//
//	p, err := consumer.New(pool, "ledger", handle, nil)
//	c, err := kafkagoconsumer.New(p, &kafkagoconsumer.Config{Reader: kafka.ReaderConfig{
//		Brokers:     []string{"localhost:9092"},
//		GroupTopics: []string{"payments"},
//	}})
//	err = c.Run(ctx) // until ctx is canceled
//
// The Consumer does not use kafka-go's Reader, which hides what a correct
// consumer needs. It joins the group with kafka-go's ConsumerGroup and
// works generation by generation:
//
//   - Each assigned partition is fetched on its own (kafka.Client.Fetch),
//     so a partition whose queue is full (a slow handler, retries, a
//     missing dead-letter topic) holds up only itself.
//   - Offsets of finished messages (committed transaction, duplicate or
//     dead letter) are committed through the generation every
//     CommitInterval. When the generation ends (a member joins or leaves,
//     this member lost its session, shutdown), every partition stops
//     taking work, transactions in flight get RevokeGrace (ShutdownGrace
//     at shutdown) to finish before their handlers' ctx is canceled and
//     they roll back, what finished is committed, and only then does the
//     member rejoin. kafka-go's rebalances revoke every partition of the
//     member, so a handler stuck on one partition holds the others up
//     for RevokeGrace (default 1s, at most a quarter of
//     Reader.RebalanceTimeout, so the member rejoins in time), not until
//     it returns; one that ignores its canceled ctx is abandoned and can
//     no longer commit.
//     The broker refuses commits of a generation that is over, so a member
//     never commits for a partition it no longer owns and a committed
//     offset never moves backwards.
//   - A change in a consumed topic's partition count (partitions added,
//     the topic created again) ends the generation, so the group assigns
//     the partitions anew; it is checked every
//     Reader.PartitionWatchInterval (5s).
//     A partition whose fetch finds its topic gone stops for the rest of
//     the generation: the topic may be created again under its name, and
//     the offset fetched up to belongs to the old one. Offsets of the old
//     topic are no longer committed. The generation ends once the topic
//     exists again, and the partition starts over from the group's
//     committed offset, which Kafka dropped with the topic, so from
//     Reader.StartOffset. While the topic is gone the group does not
//     rejoin: kafka-go's join asks for the topics' partitions with
//     auto-creation allowed, and a broker with auto.create.topics.enable
//     (Kafka's default) would create the deleted topic again at once, with
//     its default partition count. A rebalance for another reason in that
//     time (a member joining or leaving) still does: delete consumed
//     topics with auto-creation off (as managed clusters have it), or use
//     kgoconsumer. kafka-go knows no topic ids: a topic deleted and
//     created again while its fetch waited on a full queue, and before
//     the partition check ran, goes unnoticed, and its first messages
//     can be skipped.
//   - Transaction markers (commit and abort control records) are told
//     apart by their batch's control attribute, as the protocol defines
//     them, and only move the offset on. Every other record is a message,
//     whatever its key and value look like.
//   - Records of aborted transactions are not filtered out
//     (read_committed with Reader.IsolationLevel only stops fetching at
//     the last stable offset): use kgoconsumer for topics written by
//     transactional producers that abort. onceflow's relay does not use
//     transactions.
//   - Each assigned partition is fetched by a long poll of its own, and
//     kafka-go's Transport does not multiplex requests on a connection:
//     a member holds one connection (a TLS and SASL handshake each) per
//     assigned partition to its leader, and a few more for the group
//     (measured: 67 for 64 partitions on one broker; franz-go uses one
//     per broker). A group of 10 members over 1,000 partitions holds about
//     1,000 connections: use kgoconsumer for many partitions, or for a
//     managed cluster with a connection limit.
//   - On a compacted topic the log cleaner can remove the last records of
//     a batch (or all of them) and keep the batch's last offset, which
//     kafka-go does not expose; a fetch below it returns the batch again.
//     The partition then finds the batch's end by fetching single batches
//     at offsets past it (doubling, then bisecting: about 2·log2 of the
//     gap), never skipping a record, where kafka-go's own Reader would
//     stall.
//
// The default dead-letter Writer uses RequiredAcks all, murmur2
// partitioning and a 5ms BatchTimeout; kafka-go's defaults (no acks, 1s)
// would lose dead letters or stall the partition. Its BatchBytes is 64 MiB,
// so that the dead-letter topic's max.message.bytes, not kafka-go's 1 MiB,
// is what refuses a dead letter too large.
package kafkagoconsumer
