package main

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
)

// envNames is every environment variable the binary reads, whichever
// command reads it: one environment is often shared by a deployment's relay,
// its migration job and its operators' shells, so a variable of another
// command is not a mistake. TestEnvNamesMatchTheHelp keeps the list and the
// flags' help in step.
var envNames = []string{
	"ONCEFLOW_BATCH_BYTES",
	"ONCEFLOW_BATCH_SIZE",
	"ONCEFLOW_BROKERS",
	"ONCEFLOW_COMPRESSION",
	"ONCEFLOW_DATABASE_PASSWORD_FILE",
	"ONCEFLOW_DATABASE_POOL_SIZE",
	"ONCEFLOW_DATABASE_URL",
	"ONCEFLOW_HTTP_ADDR",
	"ONCEFLOW_INSTANCE_ID",
	"ONCEFLOW_KAFKA_AWS_REGION",
	"ONCEFLOW_KAFKA_CHECK_INTERVAL",
	"ONCEFLOW_KAFKA_CLIENT_ID",
	"ONCEFLOW_KAFKA_HANDOFF",
	"ONCEFLOW_KAFKA_SASL_MECHANISM",
	"ONCEFLOW_KAFKA_SASL_PASSWORD", // no flag: command lines show in ps
	"ONCEFLOW_KAFKA_SASL_PASSWORD_FILE",
	"ONCEFLOW_KAFKA_SASL_USERNAME",
	"ONCEFLOW_KAFKA_TLS",
	"ONCEFLOW_KAFKA_TLS_CA_FILE",
	"ONCEFLOW_KAFKA_TLS_CERT_FILE",
	"ONCEFLOW_KAFKA_TLS_INSECURE_SKIP_VERIFY",
	"ONCEFLOW_KAFKA_TLS_KEY_FILE",
	"ONCEFLOW_KAFKA_TLS_SERVER_NAME",
	"ONCEFLOW_LEASE_DURATION",
	"ONCEFLOW_LINGER",
	"ONCEFLOW_LOG_FORMAT",
	"ONCEFLOW_LOG_LEVEL",
	"ONCEFLOW_MAX_HELD_KEYS",
	"ONCEFLOW_MAX_RECORD_BYTES",
	"ONCEFLOW_MIGRATE_LOCK_TIMEOUT",
	"ONCEFLOW_POLL_INTERVAL",
	"ONCEFLOW_PROBE_INTERVAL",
	"ONCEFLOW_PUBLISHER",
	"ONCEFLOW_PUBLISH_TIMEOUT",
	"ONCEFLOW_SCHEMA",
	"ONCEFLOW_TOPIC_FORBIDDEN_GRACE",
	"ONCEFLOW_UNKNOWN_TOPIC_GRACE",
	"ONCEFLOW_WAIT_FOR_DATABASE",
}

// unknownEnv describes each ONCEFLOW_ variable of environ (os.Environ's
// form) that the binary does not read, naming the variable it most likely
// meant: a mistyped name is otherwise silently ignored, and the setting it
// was for left at its default (a relay with no /metrics, say). Variables of
// the project's own tests (ONCEFLOW_TEST_*, ONCEFLOW_BENCH_*) are left
// alone.
func unknownEnv(environ []string) []string {
	var out []string
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(name, "ONCEFLOW_") || strings.HasPrefix(name, "ONCEFLOW_TEST_") || strings.HasPrefix(name, "ONCEFLOW_BENCH_") {
			continue
		}
		if _, known := slices.BinarySearch(envNames, name); known {
			continue
		}
		msg := fmt.Sprintf("%s is set, but onceflow reads no such variable: it is ignored", name)
		if near := nearestEnvName(name); near != "" {
			msg += fmt.Sprintf(" (did you mean %s?)", near)
		}
		out = append(out, msg)
	}
	slices.Sort(out)
	return out
}

// warnUnknownEnv prints unknownEnv's lines for the process's environment
// to w, for the commands that do not log: as "onceflow: warning: ..." lines
// for a person, or, with format json, as JSON log lines at Warn, as the
// relay writes them, for a pipeline that parses a Job's stderr. A level
// above warn (error) leaves them out. A format or level that does not
// parse (a usage error to come) gives the text lines.
func warnUnknownEnv(w io.Writer, format, level string) {
	msgs := unknownEnv(os.Environ())
	var lvl slog.Level
	if lvl.UnmarshalText([]byte(level)) == nil && lvl > slog.LevelWarn {
		return
	}
	if format == "json" {
		c := common{logFormat: format, logLevel: level}
		if log, err := c.logger(w); err == nil {
			for _, msg := range msgs {
				log.Warn(msg)
			}
			return
		}
	}
	for _, msg := range msgs {
		fmt.Fprintln(w, "onceflow: warning:", msg)
	}
}

// nearestEnvName returns the known name closest to name, if it is within
// a few edits (a typo, a transposition, a missing word's part), else "".
func nearestEnvName(name string) string {
	best, bestDist := "", 4
	for _, known := range envNames {
		if d := editDistance(name, known); d < bestDist {
			best, bestDist = known, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
