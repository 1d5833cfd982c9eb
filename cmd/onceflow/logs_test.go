package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// The binary's logs keep one event on one line, even for pgx's multi-line
// errors, and write durations readably ("1.5s"), in text and in JSON
// (slog's JSON handler writes nanosecond integers).
func TestLogsAreOneLineWithReadableDurations(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Two unreachable hosts: pgx joins both failures with "\n\t".
	_, connErr := pgx.Connect(ctx, "postgres://u@127.0.0.1:1,127.0.0.1:2/db?connect_timeout=2")
	if connErr == nil || !strings.Contains(connErr.Error(), "\n") {
		t.Fatalf("want a multi-line pgx error to log, got %v", connErr)
	}
	for _, format := range []string{"text", "json"} {
		t.Run(format, func(t *testing.T) {
			var buf bytes.Buffer
			c := common{logLevel: "info", logFormat: format}
			log, err := c.logger(&buf)
			if err != nil {
				t.Fatal(err)
			}
			log.Warn("relay: lease upkeep failed", "error", fmt.Errorf("heartbeat: %w", connErr), "backoff", 1500*time.Millisecond)
			out := buf.String()
			if strings.Count(out, "\n") != 1 || strings.Contains(out, `\n`) || strings.Contains(out, "\t") || strings.Contains(out, `\t`) {
				t.Fatalf("not one clean line: %q", out)
			}
			if !strings.Contains(out, "failed to connect") {
				t.Fatalf("error text lost: %q", out)
			}
			switch format {
			case "text":
				if !strings.Contains(out, "backoff=1.5s") {
					t.Fatalf("duration not readable: %q", out)
				}
			case "json":
				var m map[string]any
				if err := json.Unmarshal([]byte(out), &m); err != nil {
					t.Fatal(err)
				}
				if m["backoff"] != "1.5s" {
					t.Fatalf("backoff = %#v, want \"1.5s\"", m["backoff"])
				}
			}
		})
	}
}
