// Package deadletter holds what the consumer adapters share about
// publishing dead letters.
package deadletter

import (
	"context"
	"sync"
)

// MaxBytes is the largest dead letter the adapters' default producers
// send, so that the dead-letter topic's max.message.bytes, not the
// client's own default limit (about 1 MB in franz-go and kafka-go), is
// what refuses a large one: a refused dead letter goes out again without
// the original's value. It stays well below Kafka's socket.request.max.bytes
// (100 MiB by default), past which the broker closes the connection
// rather than answer MESSAGE_TOO_LARGE.
const MaxBytes = 64 << 20

// TopicTurns lets one dead letter at a time be published to each topic.
// Published together, dead letters to a topic's partition share a record
// batch, and the broker judges the batch against max.message.bytes: two
// that each fit would both be refused as too large, and both lose their
// value. Dead letters are rare, so taking turns costs little. The zero
// value is ready; safe for concurrent use.
type TopicTurns struct {
	mu    sync.Mutex
	turns map[string]chan struct{}
}

// Take waits for topic's turn, or ctx; the returned func ends the turn.
func (t *TopicTurns) Take(ctx context.Context, topic string) (done func(), err error) {
	t.mu.Lock()
	if t.turns == nil {
		t.turns = map[string]chan struct{}{}
	}
	turn := t.turns[topic]
	if turn == nil {
		turn = make(chan struct{}, 1)
		t.turns[topic] = turn
	}
	t.mu.Unlock()
	select {
	case turn <- struct{}{}:
		return func() { <-turn }, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}
