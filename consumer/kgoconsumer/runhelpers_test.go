package kgoconsumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/internal/kafkatest"
)

// runInBackground runs c until the test ends (then stops it and waits for
// Run). The channel yields what Run returned, should it return before.
func runInBackground(t *testing.T, c *kgoconsumer.Consumer) <-chan error {
	t.Helper()
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		done <- c.Run(ctx)
	}()
	t.Cleanup(func() {
		stop()
		<-finished
	})
	return done
}

// waitCommitted waits up to timeout for group's committed offset of
// topic's partition 0 to reach want, failing the test if Run returns
// first, and returns the last offset seen (-1 for none).
func waitCommitted(t *testing.T, k *kafkatest.Kafka, done <-chan error, group, topic string, want int64, timeout time.Duration) int64 {
	t.Helper()
	adm := k.Admin(t)
	committed := int64(-1)
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		select {
		case err := <-done:
			t.Fatalf("Run returned early: %v", err)
		default:
		}
		if offs, err := adm.FetchOffsets(context.Background(), group); err == nil {
			if o, ok := offs.Lookup(topic, 0); ok {
				committed = o.At
			}
		}
		if committed >= want {
			break
		}
	}
	return committed
}
