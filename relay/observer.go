package relay

import "time"

// Observer receives the relay's events, for metrics. Its methods are called
// from the relay's goroutines, must be cheap and safe for concurrent use, and
// must not block. The binary wires a Prometheus Observer; this package
// imports no metrics library.
type Observer interface {
	// ObserveBatch is called after each publish round that read events,
	// once its outcome is recorded (or recording it failed). A round whose
	// read fails (the database unreachable) is not observed: it is logged
	// at Warn and retried with backoff. A database outage longer than
	// Config.LeaseDuration shows through ObserveShards instead: the leases
	// lapse, 0 owned shards.
	ObserveBatch(BatchStats)
	// ObserveShards is called when the set of owned shards changes.
	ObserveShards(owned int)
}

// BatchStats describes one publish round.
type BatchStats struct {
	Published int // acknowledged by Kafka and deleted from the outbox
	Failed    int // failed with a passing error; left pending for retry
	// TimedOut counts the failed events (included in Failed) that were
	// not acknowledged within Config.PublishTimeout.
	TimedOut int
	// HeldBack counts the failed events (included in Failed) not sent
	// because their key's partition is marked sick (see
	// Config.PublishTimeout).
	HeldBack int
	// SickPartitions is how many partitions the relay has marked sick
	// (not acknowledging within Config.PublishTimeout) after the round.
	// It is reported with the round's outcome, which may come after a
	// later change: SickPartitionObserver has every change, in order.
	SickPartitions int
	// SickPartitionsReported: the relay also reports the changes of
	// SickPartitions to the Observer, as a SickPartitionObserver; an
	// Observer that sums those must not count SickPartitions too.
	SickPartitionsReported bool
	DeadLettered           int // moved to outbox_dead
	// NotDeleted counts acknowledged events whose delete was refused
	// because this relay no longer owned their shard; the new owner
	// publishes them again.
	NotDeleted int
	Duration   time.Duration
	// OldestCreatedAt is the creation time of the oldest published event,
	// zero if none was published.
	OldestCreatedAt time.Time
}

// SickPartitionObserver is an optional interface of an Observer: when
// Config.Observer implements it, SickPartitionsChanged is called from the
// publish loop, in order, each time the number of partitions the relay
// holds sick changes, with the change (+1 for a partition marked, -1 for
// one cleared), and when Run ends with minus what the relay still holds.
// The changes of all the relays that report to one Observer add up to the
// partitions they hold sick. A gauge needs it: BatchStats.SickPartitions
// comes only with rounds that read events, so a mark dropped at the start
// of a round that reads nothing (no key waits on the partition any more)
// never reached it; a round's outcome is recorded beside the next round,
// so its count can be older than a change that round made; and a count
// cannot be summed across relays. An Observer that wraps another should
// pass these calls on (otelonceflow's does); BatchStats.SickPartitionsReported
// says whether a relay made them. Cheap, safe for concurrent use, must not
// block.
type SickPartitionObserver interface {
	SickPartitionsChanged(delta int)
}

type nopObserver struct{}

func (nopObserver) ObserveBatch(BatchStats) {}
func (nopObserver) ObserveShards(int)       {}
