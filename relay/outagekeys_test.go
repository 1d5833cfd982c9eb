package relay_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// A broker outage (every partition answering NOT_ENOUGH_REPLICAS) over a
// backlog of many distinct keys: every key the relay reads fails or is held
// back. What the relay remembers of failed keys must not grow with the
// number of keys it saw fail (each is left out of every read by name), so
// once the outage ends the backlog drains promptly (unloaded, in about
// 20 s; main did not in 3 minutes), each key's events in
// order (G3), none dead-lettered (G7). Before Config.MaxHeldKeys, a 20 s
// outage over 20,000 keys left the relay unable to drain them in 3 minutes.
func TestOutageOverManyKeysDrainsPromptlyOnceOver(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fake := b.kafka.RequireFake(t)
	topic := b.kafka.Topic(t, 8)
	h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.NotEnoughReplicas, Count: -1})
	const keys = 10000
	msgs := make([]outbox.Message, 0, 2*keys)
	for _, which := range []string{"first", "second"} {
		for i := range keys {
			msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint("order-", i)), Value: []byte(fmt.Sprint(i, "/", which))})
		}
	}
	b.write(t, msgs...)
	// A cap of 256 keeps each read's list of held keys short on a slow
	// machine; the default (1,024) drains these in about 40 s unloaded.
	b.startRelay(t, relay.Config{PublishTimeout: 2 * time.Second, MaxRetryBackoff: 2 * time.Second, MaxHeldKeys: 256})
	waitFor(t, "the outage to be hit", 30*time.Second, func() bool { return h.Hits() > 0 })
	time.Sleep(15 * time.Second) // the outage lasts while the relay keeps going
	h.Remove()
	start := time.Now()
	waitFor(t, "the outbox to drain once the outage ended", 4*time.Minute, func() bool { return b.count(t, "outbox") == 0 })
	// The bound is loose for a loaded CI machine (the whole suite under
	// -race): unloaded, this takes about 20 s.
	t.Logf("drained %d events in %s after the outage", 2*keys, time.Since(start).Round(time.Millisecond))
	if d := b.count(t, "outbox_dead"); d != 0 {
		t.Fatalf("%d events dead-lettered for a passing broker error", d)
	}
	first := map[string]bool{}
	for _, r := range b.kafka.ReadAll(t, topic, 2*keys, time.Minute) {
		i, which, _ := strings.Cut(string(r.Value), "/")
		switch which {
		case "first":
			first[i] = true
		case "second":
			if !first[i] {
				t.Fatalf("order-%s: its second event reached Kafka before its first (G3)", i)
			}
		}
	}
}
