package relay_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// refuseAfterFailurePublisher fails its first call's first record with a
// passing error and refuses the rest of that call for good (invalid
// topic); later calls are acknowledged.
type refuseAfterFailurePublisher struct {
	mu    sync.Mutex
	calls int
}

func (p *refuseAfterFailurePublisher) Publish(_ context.Context, records []relay.Record) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	errs := make([]error, len(records))
	if p.calls == 1 {
		for i := range errs {
			errs[i] = fmt.Errorf("%w: INVALID_TOPIC_EXCEPTION", relay.ErrTopicInvalid)
		}
		errs[0] = errors.New("not enough replicas")
	}
	return errs
}

func (p *refuseAfterFailurePublisher) Close() error { return nil }

// A later event of a key whose earlier event failed in the same attempt is
// held back, not dead-lettered past it, whatever the publisher says of it
// (G3).
func TestRefusalOfFailedKeysLaterEventIsHeldBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.write(t,
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("1")},
		outbox.Message{Topic: "t", Key: []byte("K"), Value: []byte("2")},
	)
	b.drainWithPublisher(t, &refuseAfterFailurePublisher{})
	if n := b.count(t, "outbox_dead"); n != 0 {
		t.Fatalf("%d dead letters: a later event of a failed key was dead-lettered past it", n)
	}
}
