package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
)

// runOut runs the CLI and returns stdout alone, for outputs scripts parse.
func runOut(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := run(context.Background(), args, &out, &errOut)
	if err != nil {
		t.Logf("stderr: %s", errOut.String())
	}
	return out.String(), err
}

// status --json prints one object with the figures of the text output.
func TestStatusJSON(t *testing.T) {
	t.Parallel()
	schema, flags := deadSetup(t, 2)
	if _, err := pgtest.Pool(t).Exec(context.Background(), `INSERT INTO `+pgx.Identifier{schema, "outbox"}.Sanitize()+` (topic, value, attempts) VALUES ('t', 'a', 0), ('t', 'b', 4)`); err != nil {
		t.Fatal(err)
	}
	out, err := runOut(t, append([]string{"status", "--json"}, flags...)...)
	if err != nil {
		t.Fatal(err)
	}
	var st struct {
		Schema          string     `json:"schema"`
		Backlog         int64      `json:"backlog"`
		OldestPendingAt *time.Time `json:"oldest_pending_at"`
		OldestAge       *float64   `json:"oldest_pending_age_seconds"`
		MaxAttempts     int        `json:"max_attempts"`
		DeadLetters     int64      `json:"dead_letters"`
		Shards          int        `json:"shards"`
		UnownedShards   int        `json:"unowned_shards"`
		Relays          []any      `json:"relays"`
	}
	dec := json.NewDecoder(strings.NewReader(out))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&st); err != nil {
		t.Fatalf("status --json is not the documented object: %v\n%s", err, out)
	}
	if st.Schema != schema || st.Backlog != 2 || st.OldestPendingAt == nil || st.OldestAge == nil || st.MaxAttempts != 4 ||
		st.DeadLetters != 2 || st.Shards != 256 || st.UnownedShards != 256 || st.Relays == nil || len(st.Relays) != 0 {
		t.Fatalf("status --json: %+v\n%s", st, out)
	}
}

// dead list --json prints every field, key and value base64-encoded.
func TestDeadListJSON(t *testing.T) {
	t.Parallel()
	_, flags := deadSetup(t, 2)
	out, err := runOut(t, append([]string{"dead", "list", "--json", "--limit", "1"}, flags...)...)
	if err != nil {
		t.Fatal(err)
	}
	var dead []deadJSON
	if err := json.Unmarshal([]byte(out), &dead); err != nil {
		t.Fatalf("dead list --json: %v\n%s", err, out)
	}
	if len(dead) != 1 || dead[0].ID == 0 || dead[0].EventID == "" || dead[0].Topic != "gone" || string(dead[0].KeyBase64) != "k" ||
		string(dead[0].ValueBase64) != "v" || dead[0].Error != "unknown topic" || dead[0].Attempts != 3 || dead[0].DeadAt.IsZero() {
		t.Fatalf("dead list --json: %+v\n%s", dead, out)
	}
	if !strings.Contains(out, `"value_base64": "dg=="`) {
		t.Errorf("value not base64 in:\n%s", out)
	}
	if out, err := runOut(t, append([]string{"dead", "list", "--json"}, deadFlagsEmpty(t)...)...); err != nil || strings.TrimSpace(out) != "[]" {
		t.Errorf("dead list --json with no dead events: %v %q, want []", err, out)
	}
}

func deadFlagsEmpty(t *testing.T) []string {
	_, flags := deadSetup(t, 0)
	return flags
}

// dead discard deletes the named events for good and prints each in full,
// so the output keeps them; unknown ids discard nothing.
func TestDeadDiscardPrintsTheEvents(t *testing.T) {
	t.Parallel()
	schema, flags := deadSetup(t, 3)
	out, err := runOut(t, append([]string{"dead", "discard", "--ids", "1"}, flags...)...)
	if err != nil || !strings.Contains(out, "1  event ") || !strings.Contains(out, `value: "v"`) || !strings.Contains(out, "discarded 1 dead events") {
		t.Fatalf("discard --ids 1: %v\n%s", err, out)
	}
	out, err = runOut(t, append([]string{"dead", "discard", "--ids", "2", "--json"}, flags...)...)
	var gone []deadJSON
	if err != nil || json.Unmarshal([]byte(out), &gone) != nil || len(gone) != 1 || gone[0].ID != 2 || string(gone[0].ValueBase64) != "v" {
		t.Fatalf("discard --ids 2 --json: %v\n%s", err, out)
	}
	if _, err := runOut(t, append([]string{"dead", "discard", "--ids", "3,1"}, flags...)...); err == nil || !strings.Contains(err.Error(), "ids 1 ") {
		t.Fatalf("discard of an id already gone: err %v, want one naming id 1", err)
	}
	for _, args := range [][]string{{"dead", "discard"}, {"dead", "discard", "--ids", ","}, {"dead", "discard", "--all"}} {
		if _, err := runOut(t, append(args, flags...)...); !errors.Is(err, errUsage) {
			t.Errorf("%v: err %v, want a usage error", args, err)
		}
	}
	if n := count(t, schema, "outbox_dead"); n != 1 {
		t.Fatalf("%d dead events left, want 1 (id 3)", n)
	}
	if n := count(t, schema, "outbox"); n != 0 {
		t.Fatalf("discard put %d events into the outbox", n)
	}
}

// Each subcommand's --help shows its own flags only.
func TestHelpShowsOnlyTheCommandsFlags(t *testing.T) {
	t.Parallel()
	cases := []struct {
		args          []string
		want, notWant []string
	}{
		{[]string{"dead", "list"}, []string{"-limit", "-json", "-database-url"}, []string{"-ids", "-all"}},
		{[]string{"dead", "replay"}, []string{"-ids", "-all"}, []string{"-limit", "-json"}},
		{[]string{"dead", "discard"}, []string{"-ids", "-json"}, []string{"-all", "-limit"}},
		{[]string{"migrate", "up"}, []string{"-database-url", "-schema"}, []string{"-steps", "-force", "-version"}},
		{[]string{"migrate", "down"}, []string{"-steps", "-force"}, []string{"-version"}},
		{[]string{"migrate", "status"}, []string{"-schema"}, []string{"-steps", "-force"}},
		{[]string{"migrate", "print"}, []string{"-schema", "-version", "-down"}, []string{"-database-url", "-steps"}},
		{[]string{"status"}, []string{"-json"}, []string{"-brokers", "-ids"}},
		{[]string{"demo"}, []string{"-allow-remote-brokers", "-embedded-postgres"}, []string{"-schema", "-log-level", "(env ONCEFLOW_"}},
	}
	for _, c := range cases {
		var out, errOut bytes.Buffer
		err := run(context.Background(), append(c.args, "--help"), &out, &errOut)
		help := out.String() + errOut.String()
		if !errors.Is(err, flag.ErrHelp) {
			t.Errorf("%v --help: err %v", c.args, err)
		}
		for _, w := range c.want {
			if !strings.Contains(help, "  "+w) {
				t.Errorf("%v --help lacks %s:\n%s", c.args, w, help)
			}
		}
		for _, n := range c.notWant {
			if strings.Contains(help, "  "+n) || (strings.HasPrefix(n, "(env") && strings.Contains(help, n)) {
				t.Errorf("%v --help shows %s:\n%s", c.args, n, help)
			}
		}
	}
}

// failingWriter fails every write, as stdout does on a full disk or a
// closed pipe (`onceflow dead discard … | head -1`).
type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, errors.New("no space left on device") }

// The printed events are the only copy of what dead discard deletes: when
// they cannot be written, nothing is deleted and the command fails. The
// rows were deleted first and the write's error ignored (text) or
// reported after the delete had committed (--json).
func TestDeadDiscardKeepsTheEventsWhenTheCopyCannotBeWritten(t *testing.T) {
	t.Parallel()
	schema, flags := deadSetup(t, 2)
	for _, extra := range [][]string{nil, {"--json"}} {
		args := append(append([]string{"dead", "discard", "--ids", "1,2"}, extra...), flags...)
		var errOut bytes.Buffer
		if err := run(context.Background(), args, failingWriter{}, &errOut); err == nil {
			t.Errorf("%v: succeeded with its output lost", extra)
		}
		if n := count(t, schema, "outbox_dead"); n != 2 {
			t.Fatalf("%v: %d dead events left after a discard whose copy was lost, want 2", extra, n)
		}
	}
}

// slowWriter takes its time over each write, as a stdout piped into a
// reader that does not read does.
type slowWriter struct{ d time.Duration }

func (w slowWriter) Write(p []byte) (int, error) { time.Sleep(w.d); return len(p), nil }

// dead discard does not hold its transaction (row locks, the vacuum
// horizon) open for as long as its stdout blocks: past
// discardWriteTimeout the server ends it and nothing is discarded.
func TestDeadDiscardDoesNotWaitOnABlockedStdoutForever(t *testing.T) {
	schema, flags := deadSetup(t, 1)
	defer func(d time.Duration) { discardWriteTimeout = d }(discardWriteTimeout)
	discardWriteTimeout = 200 * time.Millisecond
	var errOut bytes.Buffer
	err := run(context.Background(), append([]string{"dead", "discard", "--ids", "1"}, flags...), slowWriter{time.Second}, &errOut)
	if err == nil {
		t.Fatal("discard succeeded though its transaction sat idle past the timeout")
	}
	if n := count(t, schema, "outbox_dead"); n != 1 {
		t.Fatalf("%d dead events left, want 1: nothing discarded", n)
	}
}

// slowBuffer keeps what is written, taking its time over each write.
type slowBuffer struct {
	d time.Duration
	bytes.Buffer
}

func (w *slowBuffer) Write(p []byte) (int, error) { time.Sleep(w.d); return w.Buffer.Write(p) }

// dead discard says it discarded only once its delete has committed: when
// the commit fails (its transaction sat idle past discardWriteTimeout
// while stdout was slow), stdout said "discarded 1 dead events" and the
// error did not say the events were still there.
func TestDeadDiscardSaysDiscardedOnlyAfterTheCommit(t *testing.T) {
	schema, flags := deadSetup(t, 1)
	defer func(d time.Duration) { discardWriteTimeout = d }(discardWriteTimeout)
	discardWriteTimeout = 200 * time.Millisecond
	stdout := &slowBuffer{d: time.Second}
	var errOut bytes.Buffer
	err := run(context.Background(), append([]string{"dead", "discard", "--ids", "1"}, flags...), stdout, &errOut)
	if err == nil || !strings.Contains(err.Error(), "nothing was discarded") {
		t.Fatalf("discard whose commit failed: err %v, want one saying nothing was discarded\n%s", err, stdout.String())
	}
	if strings.Contains(stdout.String(), "discarded 1") {
		t.Fatalf("stdout says the event was discarded though it is still there:\n%s", stdout.String())
	}
	if !strings.Contains(stdout.String(), "before the commit") || !strings.Contains(stdout.String(), `value: "v"`) {
		t.Fatalf("stdout lacks the copy, labelled as taken before the commit:\n%s", stdout.String())
	}
	if n := count(t, schema, "outbox_dead"); n != 1 {
		t.Fatalf("%d dead events left, want 1: nothing discarded", n)
	}
}

// A commit the server answered with an error, or never sent, discarded
// nothing; a connection lost after COMMIT was sent leaves it unknown.
func TestDeadDiscardCommitErrorSaysWhatIsKnown(t *testing.T) {
	t.Parallel()
	for err, want := range map[error]string{
		&pgconn.PgError{Severity: "FATAL", Code: "25P03"}: "nothing was discarded",
		pgx.ErrTxCommitRollback:                           "nothing was discarded",
		io.ErrUnexpectedEOF:                               "outcome unknown",
	} {
		if got := discardCommitError(err); !strings.Contains(got.Error(), want) || !errors.Is(got, err) {
			t.Errorf("commit error %v: %v, want %q and the error wrapped", err, got, want)
		}
	}
}

// status measures ages on the database's clock (Status.ReadAt), not on
// the operator's machine's: a laptop an hour off showed every relay's last
// heartbeat an hour ago (helper 86).
func TestStatusAgesAreOnTheDatabasesClock(t *testing.T) {
	readAt := time.Now().Add(-time.Hour)
	oldest := readAt.Add(-5 * time.Second)
	var out bytes.Buffer
	if err := printStatusJSON(&out, "s", &relay.Status{OldestPending: &oldest, ReadAt: readAt}); err != nil {
		t.Fatal(err)
	}
	var got struct {
		Age float64 `json:"oldest_pending_age_seconds"`
	}
	if err := json.Unmarshal(out.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	if got.Age != 5 {
		t.Errorf("oldest_pending_age_seconds %v, want 5 (ReadAt - OldestPending)", got.Age)
	}
}
