package conformance

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// The crash tests run consumers in child processes: the test binary
// re-executes itself with childEnv set, and the adapter's TestMain hands
// control to MaybeChild before any test runs.
const childEnv = "ONCEFLOW_CONSUMER_CHILD"

// Child modes.
const (
	modeNormal       = "normal"        // process until SIGTERM
	modeBeforeCommit = "before-commit" // block in the handler, after the dedup insert
	modeAfterCommit  = "after-commit"  // block after the database commit, before the offset is marked
	modeHold         = "hold"          // block in the handler until a line arrives on stdin
)

// MaybeChild runs the child consumer and exits when the process was started
// as one; otherwise it returns at once. Call it first in TestMain.
func MaybeChild(a Adapter) {
	if os.Getenv(childEnv) == "" {
		return
	}
	if err := childMain(a); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func childMain(a Adapter) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	get := func(k string) string { return os.Getenv("OF_" + k) }
	pool, err := pgxpool.New(ctx, get("DB"))
	if err != nil {
		return err
	}
	defer pool.Close()
	var outMu sync.Mutex
	say := func(format string, args ...any) {
		outMu.Lock()
		defer outMu.Unlock()
		fmt.Fprintf(os.Stdout, format+"\n", args...)
	}
	mode, name := get("MODE"), get("NAME")
	effects := pgx.Identifier{get("SCHEMA"), "effects"}.Sanitize()
	lines := make(chan string)
	go func() {
		s := bufio.NewScanner(os.Stdin)
		for s.Scan() {
			lines <- s.Text()
		}
	}()
	block := func() { select {} }
	handler := func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		say("HANDLER %s", m.ID)
		switch mode {
		case modeBeforeCommit:
			block()
		case modeHold:
			select {
			case <-lines:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return record(ctx, tx, effects, name, m)
	}
	hook := doneFunc(func(e consumer.DoneEvent) {
		say("DONE %s %s", e.Outcome, e.Message.ID)
		if mode == modeAfterCommit && e.Outcome == consumer.Processed {
			block()
		}
	})
	p, err := consumer.New(pool, name, handler, &consumer.Config{
		Schema: get("SCHEMA"), Hooks: []consumer.Hook{hook}, MinBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
	})
	if err != nil {
		return err
	}
	r, err := a.New(p, strings.Split(get("BROKERS"), ","), get("GROUP"), []string{get("TOPIC")}, Options{})
	if err != nil {
		return err
	}
	say("READY")
	return r.Run(ctx)
}

type doneFunc func(consumer.DoneEvent)

func (f doneFunc) OnDone(e consumer.DoneEvent) { f(e) }

// child is a consumer process.
type child struct {
	t     *testing.T
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
	exit  chan error
	mu    sync.Mutex
	seen  []string
}

func (e *env) startChild(t *testing.T, mode, name, group, topic string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(),
		childEnv+"=1",
		"OF_DB="+pgtest.URL(t),
		"OF_SCHEMA="+e.schema,
		"OF_BROKERS="+strings.Join(e.k.Brokers, ","),
		"OF_TOPIC="+topic,
		"OF_GROUP="+e.group(group),
		"OF_NAME="+name,
		"OF_MODE="+mode,
	)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = &testWriter{t: t}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{t: t, cmd: cmd, stdin: stdin, lines: make(chan string, 10000), exit: make(chan error, 1)}
	go func() {
		s := bufio.NewScanner(stdout)
		for s.Scan() {
			c.mu.Lock()
			c.seen = append(c.seen, s.Text())
			c.mu.Unlock()
			c.lines <- s.Text()
		}
		c.exit <- cmd.Wait()
		close(c.lines)
	}()
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	return c
}

// waitLine waits for a line starting with prefix and returns it.
func (c *child) waitLine(prefix string, timeout time.Duration) string {
	c.t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case l, ok := <-c.lines:
			if !ok {
				c.t.Fatalf("child exited while waiting for %q", prefix)
			}
			if strings.HasPrefix(l, prefix) {
				return l
			}
		case <-deadline:
			c.t.Fatalf("child: no %q line within %v", prefix, timeout)
		}
	}
}

// has reports whether the child printed line.
func (c *child) has(line string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, l := range c.seen {
		if l == line {
			return true
		}
	}
	return false
}

// kill sends SIGKILL and waits for the process to be gone.
func (c *child) kill() {
	c.t.Helper()
	if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		c.t.Fatalf("kill: %v", err)
	}
	c.drainExit(10 * time.Second)
}

// term sends SIGTERM and checks a clean exit.
func (c *child) term() {
	c.t.Helper()
	if err := c.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		c.t.Fatalf("term: %v", err)
	}
	if err := c.drainExit(30 * time.Second); err != nil {
		c.t.Fatalf("child exit after SIGTERM: %v (want 0)", err)
	}
}

func (c *child) drainExit(timeout time.Duration) error {
	c.t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case _, ok := <-c.lines:
			if !ok {
				return <-c.exit
			}
		case <-deadline:
			c.t.Fatalf("child did not exit within %v", timeout)
		}
	}
}

type testWriter struct{ t *testing.T }

func (w *testWriter) Write(b []byte) (int, error) {
	w.t.Logf("child stderr: %s", strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

// testCrashAfterCommit: the consumer dies after its database commit and
// before its offset commit. The message is delivered again and skipped.
func testCrashAfterCommit(t *testing.T, a Adapter) {
	e := setup(t, a)
	topic := e.k.Topic(t, 1)
	e.produce(t, topic, rec{id: "id-0", value: "a"}, rec{id: "id-1", value: "b"})
	c := e.startChild(t, modeAfterCommit, "ledger", "g", topic)
	c.waitLine("DONE processed id-0", 30*time.Second)
	c.kill()
	if got := e.count(t, ""); got != 1 {
		t.Fatalf("effects after the kill = %d, want 1 (committed)", got)
	}
	if off := e.committedOffset(t, "g", topic, 0); off > 0 {
		t.Fatalf("committed offset %d after the kill, want none: the kill came before the offset commit", off)
	}
	c2 := e.startChild(t, modeNormal, "ledger", "g", topic)
	e.waitCommitted(t, "g", topic, 60*time.Second)
	c2.term()
	if !c2.has("DONE duplicate id-0") {
		t.Fatalf("the restarted consumer did not skip id-0 as a duplicate; it printed %v", c2.seen)
	}
	e.exactlyOnce(t, "ledger", 2)
}

// testCrashBeforeCommit: the consumer dies inside the handler, before its
// database commit. Nothing of it survives, and the redelivered message is
// processed.
func testCrashBeforeCommit(t *testing.T, a Adapter) {
	e := setup(t, a)
	topic := e.k.Topic(t, 1)
	e.produce(t, topic, rec{id: "id-0", value: "a"})
	c := e.startChild(t, modeBeforeCommit, "ledger", "g", topic)
	c.waitLine("HANDLER id-0", 30*time.Second)
	c.kill()
	c2 := e.startChild(t, modeNormal, "ledger", "g", topic)
	c2.waitLine("DONE processed id-0", 60*time.Second)
	e.waitCommitted(t, "g", topic, 30*time.Second)
	c2.term()
	e.exactlyOnce(t, "ledger", 1)
}

// testRacingProcesses: two processes of one consumer (same name; separate
// groups, so both receive the message) race on one id. The second blocks on
// the unique index until the first commits, then skips.
func testRacingProcesses(t *testing.T, a Adapter) {
	e := setup(t, a)
	topic := e.k.Topic(t, 1)
	e.produce(t, topic, rec{id: "id-0", value: "a"})
	first := e.startChild(t, modeHold, "ledger", "g1", topic)
	first.waitLine("HANDLER id-0", 30*time.Second)
	second := e.startChild(t, modeNormal, "ledger", "g2", topic)
	table := pgx.Identifier{e.schema, "processed_messages"}.Sanitize()
	waitFor(t, 30*time.Second, "the second process to wait on the unique index", func() bool {
		var n int
		err := e.pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND (query LIKE '%INSERT INTO '||$1||'%' OR query LIKE '%EXECUTE onceflow_dedup_%(%')`, table).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n == 1
	})
	if _, err := io.WriteString(first.stdin, "go\n"); err != nil {
		t.Fatal(err)
	}
	first.waitLine("DONE processed id-0", 30*time.Second)
	second.waitLine("DONE duplicate id-0", 30*time.Second)
	first.term()
	second.term()
	if second.has("HANDLER id-0") {
		t.Fatal("the second process ran the handler")
	}
	e.exactlyOnce(t, "ledger", 1)
}

// testRandomKills SIGKILLs consumer processes at random points while they
// work through a backlog, restarting them, then checks every message has
// exactly one effect and the group committed the end of the topic.
func testRandomKills(t *testing.T, a Adapter) {
	e := setup(t, a)
	topic := e.k.Topic(t, 2)
	const n = 400
	recs := make([]rec, n)
	for i := range recs {
		recs[i] = rec{id: "id-" + strconv.Itoa(i), key: "k" + strconv.Itoa(i%7), value: strconv.Itoa(i), partition: int32(i % 2)}
	}
	e.produce(t, topic, recs...)
	for round := range 4 {
		c := e.startChild(t, modeNormal, "ledger", "g", topic)
		c.waitLine("READY", 30*time.Second)
		after := 10 + rand.IntN(40)
		for range after {
			c.waitLine("DONE processed", 60*time.Second)
		}
		time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond) // a random instant, not a wait for a condition
		c.kill()
		t.Logf("round %d: killed after %d messages; %d effects so far", round, after, e.count(t, ""))
	}
	c := e.startChild(t, modeNormal, "ledger", "g", topic)
	e.waitCommitted(t, "g", topic, 90*time.Second)
	c.term()
	e.exactlyOnce(t, "ledger", n)
}
