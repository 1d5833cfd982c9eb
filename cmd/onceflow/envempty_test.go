package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// TestAnEmptyEnvironmentVariableCountsAsUnset: a deployment template that
// substitutes a variable nobody set (ONCEFLOW_LOG_LEVEL: "${LOG_LEVEL}")
// passes an empty value. Numbers, durations and booleans took the default
// for it, but text settings took the empty string: ONCEFLOW_SCHEMA= or
// ONCEFLOW_LOG_LEVEL= made every command exit 2, and an empty
// ONCEFLOW_KAFKA_SASL_PASSWORD counted as a password given.
func TestAnEmptyEnvironmentVariableCountsAsUnset(t *testing.T) {
	for _, v := range []string{"ONCEFLOW_SCHEMA", "ONCEFLOW_LOG_LEVEL", "ONCEFLOW_LOG_FORMAT", "ONCEFLOW_PUBLISHER",
		"ONCEFLOW_KAFKA_CLIENT_ID", "ONCEFLOW_KAFKA_SASL_PASSWORD", "ONCEFLOW_KAFKA_SASL_MECHANISM", "ONCEFLOW_POLL_INTERVAL"} {
		t.Setenv(v, "")
	}
	out, err := runCLI(t, "migrate", "print")
	if err != nil || !strings.Contains(out, `CREATE SCHEMA "onceflow"`) {
		t.Fatalf("migrate print with ONCEFLOW_SCHEMA empty: %v\n%.300s", err, out)
	}
	schema := pgtest.Schema(t)
	out, err = runCLI(t, "status", "--database-url", pgtest.URL(t), "--schema", schema)
	if err != nil || !strings.Contains(out, "backlog:         0 events") {
		t.Fatalf("status with ONCEFLOW_LOG_LEVEL and ONCEFLOW_LOG_FORMAT empty: %v\n%s", err, out)
	}
	out, _ = runCLI(t, "relay", "--help")
	for _, want := range []string{`(default "franz-go")`, `(default "onceflow-relay")`, `(default "onceflow")`, "(default 250ms)"} {
		if !strings.Contains(out, want) {
			t.Errorf("relay --help does not show %s with its variable empty", want)
		}
	}
	// The empty password is no password: without a mechanism it is not
	// "a password given", and with one it is missing.
	url := pgtest.URL(t)
	if _, err := runCLI(t, "relay", "--database-url", url, "--brokers", "a:1", "--kafka-sasl-username", "u"); err == nil || !strings.Contains(err.Error(), "required when a SASL user") {
		t.Errorf("a user without a mechanism: err = %v", err)
	}
	// --publisher is checked after the Kafka settings: reaching it means
	// the empty password was not taken for a password without a mechanism.
	if _, err := runCLI(t, "relay", "--database-url", url, "--brokers", "a:1", "--publisher", "bogus"); err == nil || !strings.Contains(err.Error(), "publisher") {
		t.Errorf("no SASL setting but the empty password: err = %v, want the flags checked past SASL", err)
	}
	// Nor is it a second password beside the password file.
	file := filepath.Join(t.TempDir(), "pw")
	if err := os.WriteFile(file, []byte("secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := runCLI(t, "relay", "--database-url", url, "--brokers", "a:1", "--kafka-sasl-mechanism", "PLAIN", "--kafka-sasl-username", "u",
		"--kafka-sasl-password-file", file, "--publisher", "bogus"); err == nil || !strings.Contains(err.Error(), "publisher") {
		t.Errorf("PLAIN with a password file and the variable empty: err = %v, want the flags checked past SASL", err)
	}
	if _, err := runCLI(t, "relay", "--database-url", url, "--brokers", "a:1", "--kafka-sasl-mechanism", "PLAIN", "--kafka-sasl-username", "u"); err == nil || !strings.Contains(err.Error(), "ONCEFLOW_KAFKA_SASL_PASSWORD (or --kafka-sasl-password-file): required") {
		t.Errorf("PLAIN with the password empty: err = %v, want it required", err)
	}
}
