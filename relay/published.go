package relay

import (
	"time"
	"unsafe"
)

// PublishedEvent describes one event Kafka acknowledged.
type PublishedEvent struct {
	// EventID is the event's id (the message-id header).
	EventID string
	Topic   string
	// Headers are the event's headers as published, message-id aside
	// (a trace context among them, when the producer recorded one). They
	// must not be modified or kept.
	Headers map[string]string
	// CreatedAt is when the event was written into the outbox, by the
	// database's clock; Acked when this relay saw Kafka's acknowledgement.
	// Acked minus CreatedAt is the event's outbox dwell time.
	CreatedAt, Acked time.Time
	// PublishStart is when the event's round began to publish.
	PublishStart time.Time
}

// EventObserver is an optional interface of an Observer: when Config.Observer
// implements it, ObservePublished is called for every event Kafka
// acknowledged, from the publish loop, once the acknowledgements of its
// round, or of the side retry that published it (an event not acknowledged
// within Config.PublishTimeout is retried beside the rounds), are in. It must be cheap, safe for concurrent use and must not block. Without
// it the relay does no per-event observer work.
type EventObserver interface {
	ObservePublished(PublishedEvent)
}

// observeAcked reports the acknowledged events of a publish attempt (a
// round or a side retry) that began at start and whose acknowledgements were
// in at now; acked holds their ids in the order of events.
func (r *Relay) observeAcked(events []pendingEvent, acked []int64, start, now time.Time) {
	j := 0
	for i := range events {
		if j == len(acked) {
			return
		}
		if e := &events[i]; e.id == acked[j] {
			j++
			r.events.ObservePublished(PublishedEvent{
				EventID: eventIDString(e.eventID), Topic: e.topic, Headers: e.headers,
				CreatedAt: e.createdAt, Acked: now, PublishStart: start,
			})
		}
	}
}

// eventIDString returns the event id's text without copying it, so that
// observing an event allocates nothing: an event id's bytes are written once
// by putUUID and never modified after (the published record's message-id
// header shares them, read-only).
func eventIDString(id []byte) string {
	if len(id) == 0 {
		return ""
	}
	return unsafe.String(unsafe.SliceData(id), len(id))
}
