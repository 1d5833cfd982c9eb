package main

import (
	"errors"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// Only --lease-duration given (longer than a minute): the relay's own
// Config defaults KafkaHandoff to max(1m, LeaseDuration), but the command
// passes its flag default (1m) explicitly, so an operator who never typed
// --kafka-handoff got a usage error about it (cold review, helper 64).
func TestALongLeaseAloneIsNotRefusedOverTheHandoff(t *testing.T) {
	url := pgtest.URL(t)
	schema := pgtest.Schema(t)
	_, err := runCLITimeout(t, 3*time.Second, "relay", "--database-url", url, "--schema", schema,
		"--brokers", "127.0.0.1:1", "--log-level", "error", "--lease-duration", "2m")
	if errors.Is(err, errUsage) {
		t.Fatalf("--lease-duration 2m alone: %v; want the relay to start (the handoff defaults to the lease)", err)
	}
}
