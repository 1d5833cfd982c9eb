package relay

import (
	"testing"
	"time"
)

type nopEvents struct{}

func (nopEvents) ObservePublished(PublishedEvent) {}

// Telling an EventObserver of acknowledged events allocates nothing: the
// binary's dwell histogram (relayprom) and tracing observe every event, so
// the per-event plumbing must cost the hot path no allocation.
func TestObservingAcknowledgedEventsAllocatesNothing(t *testing.T) {
	r := &Relay{events: nopEvents{}}
	events := make([]pendingEvent, 100)
	acked := make([]int64, len(events))
	for i := range events {
		events[i] = pendingEvent{id: int64(i + 1), eventID: formatUUID([16]byte{byte(i)}), topic: "t",
			headers: map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}, createdAt: time.Now()}
		acked[i] = int64(i + 1)
	}
	now := time.Now()
	if n := testing.AllocsPerRun(100, func() { r.observeAcked(events, acked, now, now) }); n != 0 {
		t.Fatalf("observeAcked allocated %v times per round of %d events, want 0", n, len(events))
	}
}
