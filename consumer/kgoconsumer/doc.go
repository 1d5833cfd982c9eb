// Package kgoconsumer runs a consumer.Processor over a franz-go (kgo)
// consumer group.
//
//	p, err := consumer.New(pool, "ledger", handle, nil)
//	c, err := kgoconsumer.New(p, &kgoconsumer.Config{
//		Brokers: []string{"localhost:9092"},
//		Topics:  []string{"payments"},
//	})
//	err = c.Run(ctx) // until ctx is canceled; exits cleanly, committing what finished
//
// Each assigned partition gets its own worker, so partitions proceed in
// parallel and a slow partition never stalls the others: when a
// partition's queue is full (consumer.Config.QueueSize messages or
// QueueBytes bytes) its fetching is paused, not the poll loop.
//
// Offsets are marked (kgo.AutoCommitMarks) only after a message's
// transaction committed, and committed every CommitInterval, on revocation
// and at shutdown. Rebalances wait for the poll loop (kgo.BlockRebalanceOnPoll),
// so no record of a revoked partition is queued after its revocation. On
// revocation the partition's in-flight transaction may finish within
// RevokeGrace (default 1s, at most a quarter of the rebalance timeout);
// then its handler's ctx is canceled, it rolls back, and the finished
// offsets are committed before the partition moves. A handler stuck on a
// revoked partition thus holds the rebalance up for RevokeGrace, not until
// it returns; one that ignores its canceled ctx is abandoned and can no
// longer commit. Partitions lost without a revocation (a session that
// expired) are abandoned at once and nothing more is committed for them.
// At shutdown, work in flight gets ShutdownGrace.
//
// A consumed topic deleted and created again under its name is consumed
// anew, from its start (or kgo.ConsumeResetOffset): franz-go keeps to the
// topic id it first saw and reports UNKNOWN_TOPIC_ID, and the Consumer then
// stops the topic's partitions (work in flight gets RevokeGrace), makes the
// client forget the topic and consume it again by name. Offsets of the old
// topic are not committed onto the new one (Kafka 4.2+ checks the topic id
// of a commit; see franz-go's README, "Topic recreation"). A recreated
// dead-letter topic is likewise produced to anew, and one deleted for good
// fails as missing. Partitions added to a topic are consumed after the
// client's next metadata refresh (kgo.MetadataMaxAge, 5 min by default).
//
// The client reads with read_committed, so records of aborted transactions
// and transaction markers never reach the handler. Dead letters are
// produced with the same client, acks=all whatever Config.ClientOpts say,
// and idempotent unless they disable it.
package kgoconsumer
