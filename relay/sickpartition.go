package relay

import (
	"errors"
	"fmt"
	"time"
)

// Sick partitions.
//
// A record not acknowledged within Config.PublishTimeout, or failed with a
// passing error after the client's own retries, most likely sits on a
// partition that cannot take writes (below min.insync.replicas, a leader
// moving, a broker down). Learning that one key at a time is not enough:
// with many keys on the partition, nearly every round carries a new one of
// them and waits out the whole timeout (or the client's retries), and every
// key slows to about one round per timeout.
//
// So when the publisher can tell a key's partition (PartitionReporter), the
// relay marks the partition of such a record sick. Rounds then leave
// out, without sending them, the events of every key of a sick partition:
// each such event is a failed attempt for its key only (counted, held back
// from the rounds like a timed-out event, so the key's later events wait:
// G3; never dead-lettered: G7). The side retry (sideretry.go) sends, of all
// the keys of a sick partition, only one at a time: the probe. Any record
// of the partition acknowledged (the probe's, or a timed-out key's retry)
// clears the mark, and the partition's waiting keys are retried at once.
//
// Keyless events have no partition the relay can know ahead (the
// partitioner places them as it goes, and may pick the sick partition; the
// record then waits out PublishTimeout, and so would its round). So while a
// topic has a sick partition, the rounds hold back its keyless events too
// (each is its own unit of order) and the side retry sends them beside the
// rounds; one that lands on the sick partition there times out and is sent
// again later, where the partitioner may place it elsewhere.

// topicPartition names a partition.
type topicPartition struct {
	topic     string
	partition int32
}

// sickPartition is a partition marked sick.
type sickPartition struct {
	since time.Time
	probe string // the blocked key that retries it; "" until one is chosen
}

// PartitionError fails an event the relay did not send in a round because
// its partition was marked sick (see Config.PublishTimeout). It is recorded
// as the event's last error. Partition is -1 for a keyless event of a topic
// with a sick partition: it is sent beside the rounds instead.
type PartitionError struct {
	Topic     string
	Partition int32
}

func (e *PartitionError) Error() string {
	if e.Partition < 0 {
		return fmt.Sprintf("not sent in a round: topic %s has a partition not acknowledging records, where this keyless record may land; sent beside the rounds", e.Topic)
	}
	return fmt.Sprintf("not sent: partition %d of topic %s is not acknowledging records; one probe retries it", e.Partition, e.Topic)
}

// partitionOf returns the partition of e's key, if the publisher can tell.
func (r *Relay) partitionOf(e *pendingEvent) (topicPartition, bool) {
	if r.parts == nil || e.key == nil {
		return topicPartition{}, false
	}
	p, ok := r.parts.Partition(e.topic, e.key)
	return topicPartition{e.topic, p}, ok
}

// sickOf returns the sick partition of e's key, nil if it is not sick or
// not known.
func (r *Relay) sickOf(e *pendingEvent) (topicPartition, *sickPartition) {
	if len(r.sick) == 0 || r.sick[e.topic] == nil {
		return topicPartition{}, nil
	}
	tp, ok := r.partitionOf(e)
	if !ok {
		return tp, nil
	}
	return tp, r.sick[e.topic][tp.partition]
}

// holdSick returns the events of the round to send and fills errs, for the
// events not sent because their key's partition is sick (or, keyless,
// their topic has a sick partition), with a *PartitionError. The events of
// one key all go to one partition, so a key is held whole.
func (r *Relay) holdSick(events []pendingEvent, errs []error) (send []int, held int) {
	send = make([]int, 0, len(events))
	for i := range events {
		e := &events[i]
		if e.key == nil && r.parts != nil && len(r.sick[e.topic]) > 0 {
			errs[i] = &PartitionError{Topic: e.topic, Partition: -1}
			held++
			continue
		}
		if tp, sp := r.sickOf(e); sp != nil {
			errs[i] = &PartitionError{Topic: tp.topic, Partition: tp.partition}
			held++
			continue
		}
		send = append(send, i)
	}
	return send, held
}

// markSick marks the partition of e, whose record was not acknowledged
// (in time, or with a passing error), sick, with e's key (bk) as its probe,
// and reports whether it is marked.
func (r *Relay) markSick(e *pendingEvent, bk string, err error) bool {
	tp, ok := r.partitionOf(e)
	if !ok {
		return false
	}
	byPart := r.sick[tp.topic]
	if byPart == nil {
		byPart = map[int32]*sickPartition{}
		r.sick[tp.topic] = byPart
	}
	if byPart[tp.partition] != nil {
		return true
	}
	byPart[tp.partition] = &sickPartition{since: time.Now(), probe: bk}
	r.sickCount++
	r.sickChanged()
	r.log.Warn("relay: partition did not acknowledge a record; its keys are held back and one probe retries it",
		"topic", tp.topic, "partition", tp.partition, "error", err)
	return true
}

// healthy clears the sick mark of the partition of e, whose record was
// acknowledged, and makes the partition's waiting keys due for retry now.
func (r *Relay) healthy(e *pendingEvent) {
	tp, sp := r.sickOf(e)
	if sp == nil {
		return
	}
	delete(r.sick[tp.topic], tp.partition)
	if len(r.sick[tp.topic]) == 0 {
		delete(r.sick, tp.topic)
	}
	r.sickCount--
	r.sickChanged()
	now := time.Now()
	waiting := 0
	for _, k := range r.blocked {
		if k.hasPart && k.part == tp && k.timedOut {
			k.sideAt = now
			waiting++
		}
	}
	r.log.Warn("relay: partition acknowledges again; its keys go on",
		"topic", tp.topic, "partition", tp.partition, "sick_for", now.Sub(sp.since).Round(time.Millisecond), "keys_waiting", waiting)
}

// sideGated reports whether the side retry must leave blocked key bk out
// for now: its partition is sick and another key is its probe. A partition
// whose probe is gone (published by another relay, or back in the rounds)
// takes bk as its probe.
func (r *Relay) sideGated(bk string, k *keyState) bool {
	if !k.hasPart || len(r.sick) == 0 {
		return false
	}
	sp := r.sick[k.part.topic][k.part.partition]
	if sp == nil || sp.probe == bk {
		return false
	}
	if p := r.blocked[sp.probe]; p == nil || !p.timedOut || !p.hasPart || p.part != k.part {
		sp.probe = bk
		return false
	}
	return true
}

// forgetUnprobedSick drops the marks of sick partitions none of whose keys
// is held any more (the probe's event was dead-lettered, published by
// another relay after a shard moved, or its key now maps elsewhere): no
// probe would ever clear them, and the partition's keys and the topic's
// keyless events would be held back for good. The next round sends to the
// partition again: if it is still sick, it is marked again.
func (r *Relay) forgetUnprobedSick() {
	before := r.sickCount
	defer func() {
		if r.sickCount != before {
			r.sickChanged()
		}
	}()
	for topic, byPart := range r.sick {
		for part, sp := range byPart {
			tp := topicPartition{topic, part}
			if p := r.blocked[sp.probe]; p != nil && p.hasPart && p.part == tp {
				continue
			}
			held := false
			for _, k := range r.blocked {
				if k.hasPart && k.part == tp {
					held = true
					break
				}
			}
			if held {
				continue
			}
			delete(byPart, part)
			r.sickCount--
			r.log.Warn("relay: partition marked sick has no key held any more; it is tried again", "topic", topic, "partition", part)
		}
		if len(byPart) == 0 {
			delete(r.sick, topic)
		}
	}
}

// sickChanged reports the change of the count of sick partitions since the
// last report to a SickPartitionObserver. It is called from the publish
// loop, where every mark is set and dropped, so the changes arrive in
// order; BatchStats' count, reported when a round's outcome is recorded,
// which may be after the next round dropped a mark, can be older.
func (r *Relay) sickChanged() {
	if r.sickObs == nil {
		return
	}
	if delta := r.sickCount - r.sickReported; delta != 0 {
		r.sickReported = r.sickCount
		r.sickObs.SickPartitionsChanged(delta)
	}
}

// isProbe reports whether key bk is the probe of e's sick partition.
func (r *Relay) isProbe(e *pendingEvent, bk string) bool {
	_, sp := r.sickOf(e)
	return sp != nil && sp.probe == bk
}

func isPartitionError(err error) bool {
	var pe *PartitionError
	return errors.As(err, &pe)
}
