// Package conformance is one test suite for every consumer adapter (like
// river's riverdrivertest): dedup, dead letters, the three processing
// modes, rebalances, transaction markers and, in child processes killed
// with SIGKILL, crashes around the database commit.
package conformance

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// Runner is a running consumer: an adapter's Consumer.
type Runner interface {
	Run(ctx context.Context) error
}

// Adapter builds consumers for the suite and its child processes.
type Adapter struct {
	// New returns a consumer of topics in group, with group timeouts short
	// enough for tests (a killed member must be evicted within seconds).
	New func(p *consumer.Processor, brokers []string, group string, topics []string, o Options) (Runner, error)
	// HidesAborted reports whether records of aborted transactions are
	// hidden from the handler (read_committed).
	HidesAborted bool
	// Cooperative reports whether the adapter rebalances incrementally by
	// default (a rebalance revokes only the partitions that move); the
	// rebalance tests then run with Options.Eager too.
	Cooperative bool
}

// Options are the adapter settings a suite test asks for.
type Options struct {
	// StopOnMissingDeadLetterTopic sets the adapter's option of that name.
	StopOnMissingDeadLetterTopic bool
	// Eager asks for an eager balancer: every rebalance revokes every
	// partition of every member. Adapters that only rebalance eagerly
	// ignore it.
	Eager bool
	// Logger is the adapter's Logger; nil leaves the adapter's default.
	Logger *slog.Logger
}

// env is what a suite test needs: PostgreSQL, Kafka, and an effects table
// where handlers record every committed run.
type env struct {
	a       Adapter
	k       *kafkatest.Kafka
	pool    *pgxpool.Pool
	schema  string
	effects string
	// groupSuffix makes the test's group names its own: on a real
	// broker every test shares the group namespace, and a member of
	// another test joining "g" would rebalance this test's members.
	groupSuffix string
}

// group is the Kafka group id of the test's group g.
func (e *env) group(g string) string { return g + "-" + e.groupSuffix }

func setup(t *testing.T, a Adapter) *env {
	t.Helper()
	t.Parallel()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := pool.Exec(context.Background(), `CREATE TABLE `+effects+
		` (seq bigserial, message_id text, consumer text, topic text, part int, off bigint, key text, value text)`); err != nil {
		t.Fatal(err)
	}
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	return &env{a: a, k: kafkatest.New(t), pool: pool, schema: schema, effects: effects, groupSuffix: hex.EncodeToString(suffix)}
}

func record(ctx context.Context, tx pgx.Tx, effects, name string, m consumer.Message) error {
	_, err := tx.Exec(ctx, `INSERT INTO `+effects+` (message_id, consumer, topic, part, off, key, value) VALUES ($1, $2, $3, $4, $5, $6, $7)`,
		m.ID, name, m.Topic, m.Partition, m.Offset, string(m.Key), string(m.Value))
	return err
}

// handler records the message; a value of "fail" fails, "perm" fails
// permanently.
func (e *env) handler(name string) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		switch string(m.Value) {
		case "fail":
			return errors.New("always fails")
		case "perm":
			return consumer.Permanent(errors.New("cannot parse"))
		}
		return record(ctx, tx, e.effects, name, m)
	}
}

func (e *env) processor(t *testing.T, name string, cfg *consumer.Config) *consumer.Processor {
	t.Helper()
	c := consumer.Config{}
	if cfg != nil {
		c = *cfg
	}
	c.Schema = e.schema
	if c.MinBackoff == 0 {
		c.MinBackoff, c.MaxBackoff = time.Millisecond, 10*time.Millisecond
	}
	p, err := consumer.New(e.pool, name, e.handler(name), &c)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// start runs a consumer until the returned stop is called (or the test
// ends); stop checks that Run returned nil in time.
func (e *env) start(t *testing.T, p *consumer.Processor, group string, topics ...string) (stop func()) {
	t.Helper()
	return e.startOpts(t, p, Options{}, group, topics...)
}

// startOpts is start with adapter options.
func (e *env) startOpts(t *testing.T, p *consumer.Processor, o Options, group string, topics ...string) (stop func()) {
	t.Helper()
	r := e.startWith(t, p, o, group, topics...)
	return func() {
		if err := r.stop(); err != nil {
			t.Errorf("Run: %v", err)
		}
	}
}

// running is a consumer started by startWith.
type running struct {
	t      *testing.T
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	err    error
}

// stop cancels Run and returns its error; it fails the test if Run does
// not return within 30s.
func (r *running) stop() error {
	r.once.Do(func() {
		r.cancel()
		select {
		case r.err = <-r.done:
		case <-time.After(30 * time.Second):
			r.t.Errorf("Run did not return within 30s of cancel")
		}
	})
	return r.err
}

// wait returns Run's error once it returns on its own, failing the test
// after timeout.
func (r *running) wait(timeout time.Duration) error {
	r.t.Helper()
	select {
	case err := <-r.done:
		r.once.Do(func() { r.err = err })
		return err
	case <-time.After(timeout):
		r.t.Fatalf("Run did not return on its own within %v", timeout)
		return nil
	}
}

func (e *env) startWith(t *testing.T, p *consumer.Processor, o Options, group string, topics ...string) *running {
	t.Helper()
	r, err := e.a.New(p, e.k.Brokers, e.group(group), topics, o)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	run := &running{t: t, cancel: cancel, done: make(chan error, 1)}
	go func() { run.done <- r.Run(ctx) }()
	t.Cleanup(func() { _ = run.stop() })
	return run
}

type rec struct {
	key, value, id string
	partition      int32
}

func (e *env) produce(t *testing.T, topic string, recs ...rec) {
	t.Helper()
	cl := e.k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	rs := make([]*kgo.Record, len(recs))
	for i, r := range recs {
		kr := &kgo.Record{Topic: topic, Partition: r.partition, Value: []byte(r.value)}
		if r.key != "" {
			kr.Key = []byte(r.key)
		}
		if r.id != "" {
			kr.Headers = []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte(r.id)}}
		}
		rs[i] = kr
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, rs...).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
}

// committed reports whether group committed the end offset of every
// partition of topic.
func (e *env) committed(t *testing.T, group, topic string) bool {
	t.Helper()
	adm := e.k.Admin(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err != nil {
		return false
	}
	offs, err := adm.FetchOffsets(ctx, e.group(group))
	if err != nil {
		return false
	}
	all := true
	ends.Each(func(l kadm.ListedOffset) {
		o, ok := offs.Lookup(topic, l.Partition)
		if !ok || o.At < l.Offset {
			all = false
		}
	})
	return all
}

// committedOffset returns the group's committed offset of one partition, or
// -1.
func (e *env) committedOffset(t *testing.T, group, topic string, partition int32) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	offs, err := e.k.Admin(t).FetchOffsets(ctx, e.group(group))
	if err != nil {
		t.Fatalf("fetch offsets: %v", err)
	}
	o, ok := offs.Lookup(topic, partition)
	if !ok {
		return -1
	}
	return o.At
}

func (e *env) waitCommitted(t *testing.T, group, topic string, timeout time.Duration) {
	t.Helper()
	waitFor(t, timeout, "group "+group+" to commit the end of "+topic, func() bool { return e.committed(t, group, topic) })
}

func (e *env) count(t *testing.T, where string, args ...any) int {
	t.Helper()
	var n int
	q := `SELECT count(*) FROM ` + e.effects
	if where != "" {
		q += ` WHERE ` + where
	}
	if err := e.pool.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// exactlyOnce checks that ids id-0…id-(n-1) each have exactly one effect
// for consumer name.
func (e *env) exactlyOnce(t *testing.T, name string, n int) {
	t.Helper()
	rows, err := e.pool.Query(context.Background(), `SELECT message_id, count(*) FROM `+e.effects+` WHERE consumer = $1 GROUP BY 1`, name)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (struct {
		id string
		n  int
	}, error) {
		var x struct {
			id string
			n  int
		}
		err := r.Scan(&x.id, &x.n)
		return x, err
	})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for _, g := range got {
		seen[g.id] = g.n
	}
	var missing, doubled []string
	for i := range n {
		id := "id-" + strconv.Itoa(i)
		switch c := seen[id]; {
		case c == 0:
			missing = append(missing, id)
		case c > 1:
			doubled = append(doubled, fmt.Sprintf("%s×%d", id, c))
		}
	}
	if len(missing) > 0 || len(doubled) > 0 || len(seen) != n {
		t.Fatalf("effects not exactly once: %d distinct of %d; missing %v; repeated %v", len(seen), n, head(missing), head(doubled))
	}
}

func head(s []string) []string {
	if len(s) > 10 {
		return append(s[:10:10], "…")
	}
	return s
}

func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
