package relay_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// phasedPublisher answers "unknown topic", then, for a while, a passing
// error (a broker outage), then "unknown topic" again.
type phasedPublisher struct {
	start         time.Time
	unknown, down time.Duration
	mu            sync.Mutex
	againAt       time.Time // first "unknown topic" after the outage
}

func (p *phasedPublisher) Publish(_ context.Context, records []relay.Record) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	el := time.Since(p.start)
	var err error
	switch {
	case el < p.unknown:
		err = fmt.Errorf("%w: UNKNOWN_TOPIC_OR_PARTITION", relay.ErrUnknownTopic)
	case el < p.unknown+p.down:
		err = errors.New("broker down")
	default:
		if p.againAt.IsZero() {
			p.againAt = time.Now()
		}
		err = fmt.Errorf("%w: UNKNOWN_TOPIC_OR_PARTITION", relay.ErrUnknownTopic)
	}
	errs := make([]error, len(records))
	for i := range errs {
		errs[i] = err
	}
	return errs
}

func (p *phasedPublisher) Close() error { return nil }

// The unknown-topic grace counts a continuous run of unknown-topic answers:
// an outage in between starts it again, so unknown, outage, unknown does
// not dead-let at the first answer after the outage (G7).
func TestUnknownTopicGraceCountsAContinuousRun(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.write(t, outbox.Message{Topic: "t", Key: []byte("k"), Value: []byte("v")})
	const grace = time.Second
	pub := &phasedPublisher{start: time.Now(), unknown: 600 * time.Millisecond, down: 2 * time.Second}
	b.startRelayWith(t, b.pool, pub, relay.Config{UnknownTopicGrace: grace, MaxRetryBackoff: 200 * time.Millisecond})
	waitFor(t, "the event to be dead-lettered", 30*time.Second, func() bool { return b.count(t, "outbox_dead") == 1 })
	dead, err := relay.ListDead(context.Background(), b.pool, b.schema, 1)
	if err != nil {
		t.Fatal(err)
	}
	pub.mu.Lock()
	againAt := pub.againAt
	pub.mu.Unlock()
	if againAt.IsZero() {
		t.Fatalf("dead-lettered during the outage or before it: %+v", dead[0])
	}
	if d := dead[0].DeadAt.Sub(againAt); d < grace*8/10 {
		t.Fatalf("dead-lettered %s after the topic was unknown again; the grace (%s) must count from there", d, grace)
	}
}

// TOPIC_AUTHORIZATION_FAILED is retried for TopicForbiddenGrace (an ACL
// being granted is routine), then dead-lettered; an event whose topic is
// authorized within the grace is published; an invalid topic name is
// dead-lettered at once.
func TestForbiddenTopicIsRetriedForItsGrace(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fake := b.kafka.RequireFake(t)
	forbidden := b.kafka.Topic(t, 1)
	granted := b.kafka.Topic(t, 1)
	invalid := b.kafka.Topic(t, 1)
	fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: forbidden, Err: kerr.TopicAuthorizationFailed, Count: -1})
	h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: granted, Err: kerr.TopicAuthorizationFailed, Count: -1})
	fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: invalid, Err: kerr.InvalidTopicException, Count: -1})
	b.write(t,
		outbox.Message{Topic: forbidden, Key: []byte("f"), Value: []byte("f")},
		outbox.Message{Topic: granted, Key: []byte("g"), Value: []byte("g")},
		outbox.Message{Topic: invalid, Key: []byte("i"), Value: []byte("i")},
	)
	const grace = 3 * time.Second
	b.startRelay(t, relay.Config{TopicForbiddenGrace: grace, MaxRetryBackoff: 300 * time.Millisecond})
	waitFor(t, "the granted topic's fault to be hit", 30*time.Second, func() bool { return h.Hits() > 0 })
	h.Remove() // the ACL is granted
	if got := b.kafka.ReadAll(t, granted, 1, 30*time.Second); len(got) != 1 {
		t.Fatal("the event whose topic was authorized within the grace was not published")
	}
	waitFor(t, "two dead letters", 30*time.Second, func() bool { return b.count(t, "outbox_dead") == 2 })
	dead, err := relay.ListDead(context.Background(), b.pool, b.schema, 10)
	if err != nil {
		t.Fatal(err)
	}
	byTopic := map[string]relay.DeadEvent{}
	for _, d := range dead {
		byTopic[d.Topic] = d
	}
	f, i := byTopic[forbidden], byTopic[invalid]
	if f.DeadAt.Sub(f.CreatedAt) < grace || f.Attempts < 2 || !strings.Contains(f.Error, "forbidden") {
		t.Errorf("forbidden topic dead-lettered before its grace or without reason: attempts %d after %s: %q", f.Attempts, f.DeadAt.Sub(f.CreatedAt), f.Error)
	}
	if i.Attempts != 1 || !strings.Contains(i.Error, "invalid") {
		t.Errorf("invalid topic: attempts %d, error %q; want dead-lettered at once", i.Attempts, i.Error)
	}
}
