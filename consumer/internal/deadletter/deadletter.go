// Package deadletter holds what the consumer adapters share about
// publishing dead letters.
package deadletter

import (
	"context"
	"sync"

	"golang.org/x/sync/semaphore"
)

// MaxBytes is the largest dead letter the adapters' default producers
// send, so that the dead-letter topic's max.message.bytes, not the
// client's own default limit (about 1 MB in franz-go and kafka-go), is
// what refuses a large one: a refused dead letter goes out again without
// the original's value. It stays well below Kafka's socket.request.max.bytes
// (100 MiB by default), past which the broker closes the connection
// rather than answer MESSAGE_TOO_LARGE.
const MaxBytes = 64 << 20

// Topics publishes dead letters so that each is judged alone for its size.
// Published together, dead letters to a topic's partition share a record
// batch, and the broker judges the batch against max.message.bytes: two
// that each fit would both be refused as too large, and both lose their
// value. So dead letters to a topic go out together, and one refused as
// too large is sent again alone, with no other publish to its topic in
// flight, before its refusal stands. A dead letter to a partition that
// does not answer holds up no other, but the retry alone waits for it.
// The zero value is ready; safe for concurrent use.
type Topics struct {
	mu     sync.Mutex
	topics map[string]*semaphore.Weighted
}

// alone is the weight of a publish alone: all of its topic's semaphore.
const alone = 1 << 30

// Publish calls publish(ctx) for a dead letter to topic, along with other
// publishes to topic; when tooLarge(its error), it waits until no other
// publish to topic is in flight, stops new ones, and calls publish(ctx)
// again alone, whose error stands. It returns ctx's error if ctx ends
// while it waits.
func (t *Topics) Publish(ctx context.Context, topic string, publish func(context.Context) error, tooLarge func(error) bool) error {
	sem := t.semaphore(topic)
	// Weighted is first come, first served: a publish waiting to go
	// alone keeps later ones out, so it is not starved by a steady flow.
	if err := sem.Acquire(ctx, 1); err != nil {
		return err
	}
	err := publish(ctx)
	sem.Release(1)
	if err == nil || !tooLarge(err) {
		return err
	}
	if err := sem.Acquire(ctx, alone); err != nil {
		return err
	}
	defer sem.Release(alone)
	return publish(ctx)
}

func (t *Topics) semaphore(topic string) *semaphore.Weighted {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.topics == nil {
		t.topics = map[string]*semaphore.Weighted{}
	}
	sem := t.topics[topic]
	if sem == nil {
		sem = semaphore.NewWeighted(alone)
		t.topics[topic] = sem
	}
	return sem
}
