package relay_test

import (
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/proctest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// logBuffer collects a relay's log lines (text handler); safe for
// concurrent use.
type logBuffer struct{ proctest.Buffer }

// lines returns the lines matching re.
func (l *logBuffer) lines(re string) []string {
	var out []string
	r := regexp.MustCompile(re)
	for _, line := range strings.Split(l.String(), "\n") {
		if r.MatchString(line) {
			out = append(out, line)
		}
	}
	return out
}

func newLogger(level slog.Level) (*slog.Logger, *logBuffer) {
	b := &logBuffer{}
	return slog.New(slog.NewTextHandler(b, &slog.HandlerOptions{Level: level})), b
}

// checkVocabulary fails on the attribute names the relay no longer uses:
// instance (not relay) names the relay, error (not err) the error.
func checkVocabulary(t *testing.T, logs *logBuffer) {
	t.Helper()
	for _, bad := range []string{" relay=", " err=", " first_err=", " in=", " retry_in="} {
		if strings.Contains(logs.String(), bad) {
			t.Errorf("logs use %q:\n%s", strings.TrimSpace(bad), logs.lines(regexp.QuoteMeta(bad)))
		}
	}
}

// Shards taken over and handed back are logged at Info with the relay's
// instance name: a second relay takes half the shards, the first hands
// them over.
func TestShardMovesAreLoggedAtInfo(t *testing.T) {
	t.Parallel()
	b := setup(t)
	logA, bufA := newLogger(slog.LevelInfo)
	logB, bufB := newLogger(slog.LevelInfo)
	b.startRelay(t, relay.Config{InstanceID: "relay-a", Logger: logA})
	took := `level=INFO msg="relay: took shards" instance=%s shards=%d owned=%d`
	waitFor(t, "relay-a to log taking every shard", 30*time.Second, func() bool {
		return len(bufA.lines(fmt.Sprintf(took, "relay-a", relay.NumShards, relay.NumShards))) == 1
	})
	b.startRelay(t, relay.Config{InstanceID: "relay-b", Logger: logB})
	half := relay.NumShards / 2
	waitFor(t, "relay-a to log handing half back", 30*time.Second, func() bool {
		return len(bufA.lines(fmt.Sprintf(`level=INFO msg="relay: handed shards back" instance=relay-a shards=%d owned=%d`, half, half))) == 1
	})
	waitFor(t, "relay-b to log taking them", 30*time.Second, func() bool {
		return len(bufB.lines(`level=INFO msg="relay: took shards" instance=relay-b`)) > 0
	})
	checkVocabulary(t, bufA)
	checkVocabulary(t, bufB)
}

// At debug level the loop's decisions are logged: the leases it holds, each
// round's outcome, and why it woke up.
func TestDebugLogsShowTheLoopsDecisions(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 1)
	log, buf := newLogger(slog.LevelDebug)
	b.startRelay(t, relay.Config{InstanceID: "relay-d", Logger: log, BatchSize: 10})
	var msgs []outbox.Message
	for i := range 25 {
		msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint(i % 3)), Value: []byte("v")})
	}
	b.write(t, msgs...)
	waitFor(t, "the outbox to drain", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	for what, re := range map[string]string{
		"lease upkeep": `level=DEBUG msg="relay: leases" instance=relay-d live=1 fair=256 owned=256`,
		"full round":   `level=DEBUG msg="relay: round" instance=relay-d claimed=10 published=10 failed=0 dead_lettered=0 next=at_once`,
		"idle wait":    `level=DEBUG msg="relay: idle" instance=relay-d woken_by=(notification|poll|shards)`,
	} {
		waitFor(t, "a debug line for "+what, 30*time.Second, func() bool { return len(buf.lines(re)) > 0 })
	}
	checkVocabulary(t, buf)
}
