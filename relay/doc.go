// Package relay publishes committed outbox events to Kafka: at least once
// (G2), in per-key order (G3), each with a stable message-id header (G4),
// dead-lettering only what Kafka refuses for good (G7). Several relays may
// run against one database at once.
//
//	pub, err := kgopublisher.New([]string{"kafka:9092"}, nil)
//	r, err := relay.New(pool, pub, &relay.Config{Logger: logger})
//	err = r.Run(ctx) // until ctx is canceled; then hands its shards back
//
// # How it works
//
// Events are spread over NumShards shards by a hash of their key. Each shard
// is owned by one relay at a time through a lease in relay_shards, renewed on
// the database clock; live relays share the shards evenly and take over a
// dead relay's shards when its lease lapses (Config.LeaseDuration). A relay
// reads the oldest pending events of its shards, publishes them, waits for
// every acknowledgement, then deletes exactly the acknowledged ones,
// re-checking that it still owns their shards. It keeps no cursor (a row
// committed late behind a higher id is still read) and holds no transaction
// open while Kafka answers. A failed event holds back its key's later events
// until it is retried, whatever their topics: a round carries a key's events
// on one topic only, and a later event of a key whose earlier event failed
// is not taken as published even if the publisher acknowledged it.
//
// # Waking up
//
// Nothing runs on the write path: no trigger, no NOTIFY (a notifying commit
// holds a database-wide lock through its WAL flush, so notifying writers
// queue behind one another). A relay whose round was full reads again at once;
// an idle relay probes every Config.ProbeInterval (5 ms) with one read of
// the outbox's id sequence, reads its shards when new ids appeared (and on
// every probe for the next 20, while the transactions that took them
// commit, and whenever the newest commits later), and reads them every
// Config.PollInterval (250 ms) whatever the probe says. Needing no LISTEN, the relay can run behind a transaction-mode
// pooler.
//
// A round waits at most Config.PublishTimeout for its acknowledgements. A
// record not acknowledged by then (a partition that cannot take writes) is a
// failed, passing attempt for its key alone: the rounds leave the key out
// and the relay retries that event beside them until it is acknowledged.
// It also marks the record's partition sick, when the Publisher can tell a
// key's partition (PartitionReporter; both publishers of this module can):
// later rounds do not send, and so do not wait on, the events of any key
// of that partition, nor keyless events of its topic; they are failed
// attempts for their keys alone, held back in key order, and one probe at
// a time retries the partition beside the rounds until it acknowledges.
//
// # Refusals
//
// A Publisher classifies refusals by wrapping ErrRecordTooLarge,
// ErrTopicInvalid, ErrTopicForbidden, ErrRecordInvalid or ErrUnknownTopic.
// Too large and invalid records are published alone first (a broker fails
// whole batches); an unknown topic is retried for Config.UnknownTopicGrace
// and a forbidden (not authorized) one for Config.TopicForbiddenGrace, each
// counting an unbroken run of that answer (any other answer, an outage
// included, starts the count again); then the
// event moves to outbox_dead with the error (ListDead, ReplayDead, DiscardDead). Every
// other error is passing: it is retried with backoff, forever.
//
// # Concurrency
//
// A Relay runs once (Run); New, InstanceID and OwnedShards are safe for
// concurrent use. ReadStatus (exact: a scan of the outbox), ReadBacklog
// (per shard, from index probes whose cost does not grow with the backlog;
// what the relay's /metrics report), ListDead, ReplayDead and DiscardDead
// take any Querier and may be called from anywhere.
package relay
