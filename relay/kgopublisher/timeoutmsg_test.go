package kgopublisher_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kgopublisher"
)

// A record not acknowledged when Publish's deadline passed (the relay's
// publish timeout, on a slow or throttled cluster) says so, not "before
// shutdown": the relay logs the error and stores it as the event's last
// error, and nothing was shutting down (helper 74). A call cancelled (the
// relay stopping) still says shutdown.
func TestANotAcknowledgedRecordSaysWhatEndedTheWait(t *testing.T) {
	k := kafkatest.New(t)
	fake := k.RequireFake(t)
	topic := k.Topic(t, 1)
	release := make(chan struct{})
	defer close(release)
	fake.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		fake.KeepControl()
		fake.SleepControl(func() { <-release })
		return nil, nil, false
	})
	for _, c := range []struct {
		name    string
		ctx     func() (context.Context, context.CancelFunc)
		want    string
		notWant string
	}{
		{"deadline", func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), 500*time.Millisecond)
		}, "not acknowledged within the call's deadline (the relay's publish timeout)", "shutdown"},
		{"cancel", func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(500*time.Millisecond, cancel)
			return ctx, cancel
		}, "not acknowledged before the call was cancelled (shutdown)", "deadline"},
	} {
		p, err := kgopublisher.New(k.Brokers, &kgopublisher.Config{})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := c.ctx()
		err = p.Publish(ctx, []relay.Record{{Topic: topic, Key: []byte("k"), Value: []byte("v")}})[0]
		cancel()
		_ = p.Close()
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), c.notWant) {
			t.Errorf("%s: error %v, want one saying %q", c.name, err, c.want)
		}
		if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
			t.Errorf("%s: error %v does not wrap the context's", c.name, err)
		}
	}
}
