package conformance

import (
	"context"
	"crypto/rand"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
)

// Run runs the suite against a.
func Run(t *testing.T, a Adapter) {
	t.Run("RedeliveryAndRepublishHaveOneEffect", func(t *testing.T) { testDedup(t, a) })
	t.Run("DeadLetters", func(t *testing.T) { testDeadLetters(t, a) })
	t.Run("MissingDeadLetterTopic", func(t *testing.T) { testMissingDeadLetterTopic(t, a) })
	t.Run("ForbiddenDeadLetterTopicIsNotMissing", func(t *testing.T) { testForbiddenDeadLetterTopic(t, a) })
	t.Run("DeadLetterRetriedByTheClientIsReportedFailing", func(t *testing.T) { testDeadLetterRetriedByTheClient(t, a) })
	t.Run("DeadLetterTooLargeForItsTopic", func(t *testing.T) { testDeadLetterTooLarge(t, a) })
	t.Run("RecreatedDeadLetterTopicIsWrittenTo", func(t *testing.T) { testRecreatedDeadLetterTopic(t, a) })
	t.Run("TombstoneDeadLetters", func(t *testing.T) { testTombstoneDeadLetters(t, a) })
	t.Run("InOrder", func(t *testing.T) { testMode(t, a, "in-order") })
	t.Run("KeyParallel", func(t *testing.T) { testMode(t, a, "key-parallel") })
	t.Run("Batch", func(t *testing.T) { testMode(t, a, "batch") })
	t.Run("SmallQueue", func(t *testing.T) { testMode(t, a, "small-queue") })
	t.Run("QueueBytes", func(t *testing.T) {
		t.Run("InOrder", func(t *testing.T) { testMode(t, a, "queue-bytes") })
		t.Run("Batch", func(t *testing.T) { testMode(t, a, "queue-bytes-batch") })
		t.Run("EveryMessageLarger/InOrder", func(t *testing.T) { testMode(t, a, "over-queue-bytes") })
		t.Run("EveryMessageLarger/KeyParallel", func(t *testing.T) { testMode(t, a, "over-queue-bytes-key-parallel") })
	})
	t.Run("RebalanceWhileFlowing", func(t *testing.T) { testRebalance(t, a) })
	t.Run("RecreatedTopicIsConsumedFromItsStart", func(t *testing.T) { testRecreatedTopic(t, a) })
	t.Run("DeletedTopicStaysDeleted", func(t *testing.T) { testDeletedTopicStaysDeleted(t, a) })
	t.Run("AddedPartitionsAreConsumed", func(t *testing.T) { testAddedPartitions(t, a) })
	t.Run("TransactionMarkers", func(t *testing.T) { testTransactions(t, a) })
	t.Run("MarkerShapedRecordsAreMessages", func(t *testing.T) { testMarkerShapedRecords(t, a) })
	t.Run("StuckPartitionDoesNotStallOthers", func(t *testing.T) { testStuckPartition(t, a) })
	t.Run("RebalanceWithStuckHandler", func(t *testing.T) {
		t.Run("HandlerHonoursCancel", func(t *testing.T) { testRebalanceWithStuckHandler(t, a, Options{}, true) })
		t.Run("HandlerIgnoresCancel", func(t *testing.T) { testRebalanceWithStuckHandler(t, a, Options{}, false) })
		if a.Cooperative {
			t.Run("Eager/HandlerHonoursCancel", func(t *testing.T) { testRebalanceWithStuckHandler(t, a, Options{Eager: true}, true) })
			t.Run("Eager/HandlerIgnoresCancel", func(t *testing.T) { testRebalanceWithStuckHandler(t, a, Options{Eager: true}, false) })
		}
	})
	t.Run("CommittedOffsetsNeverGoBackAcrossRebalances", func(t *testing.T) { testOffsetsNeverGoBack(t, a) })
	t.Run("ShutdownFinishesInFlight", func(t *testing.T) { testShutdownDrains(t, a) })
	t.Run("ShutdownWhileTheCoordinatorLoads", func(t *testing.T) { testShutdownWhileTheCoordinatorLoads(t, a, false) })
	t.Run("ShutdownWhileTheCoordinatorHangs", func(t *testing.T) { testShutdownWhileTheCoordinatorLoads(t, a, true) })
	t.Run("CrashAfterDatabaseCommit", func(t *testing.T) { testCrashAfterCommit(t, a) })
	t.Run("CrashBeforeDatabaseCommit", func(t *testing.T) { testCrashBeforeCommit(t, a) })
	t.Run("TwoProcessesRaceOnOneID", func(t *testing.T) { testRacingProcesses(t, a) })
	t.Run("RandomKills", func(t *testing.T) { testRandomKills(t, a) })
}

type outcomes struct{ processed, duplicate, dead atomic.Int64 }

func (o *outcomes) OnDone(e consumer.DoneEvent) {
	switch e.Outcome {
	case consumer.Processed:
		o.processed.Add(1)
	case consumer.Duplicate:
		o.duplicate.Add(1)
	case consumer.DeadLettered:
		o.dead.Add(1)
	}
}

func testDedup(t *testing.T, a Adapter) {
	e := setup(t, a)
	topic := e.k.Topic(t, 1)
	// id-0 delivered, then re-published at a new offset; then id-1.
	e.produce(t, topic, rec{id: "id-0", value: "a"}, rec{id: "id-0", value: "a again"}, rec{id: "id-1", value: "b"})
	o := &outcomes{}
	p := e.processor(t, "ledger", &consumer.Config{Hooks: []consumer.Hook{o}})
	stop := e.start(t, p, "g1", topic)
	e.waitCommitted(t, "g1", topic, 30*time.Second)
	stop()
	e.exactlyOnce(t, "ledger", 2)
	if o.duplicate.Load() != 1 {
		t.Fatalf("duplicates = %d, want 1", o.duplicate.Load())
	}
	// Every message delivered again (a new group reads from the start):
	// all skipped.
	stop = e.start(t, p, "g2", topic)
	e.waitCommitted(t, "g2", topic, 30*time.Second)
	stop()
	e.exactlyOnce(t, "ledger", 2)
	if o.duplicate.Load() != 4 || o.processed.Load() != 2 {
		t.Fatalf("processed %d duplicates %d, want 2 and 4", o.processed.Load(), o.duplicate.Load())
	}
}

func testDeadLetters(t *testing.T, a Adapter) {
	e := setup(t, a)
	topic := e.k.Topic(t, 1)
	e.k.CreateTopic(t, topic+".dlq", 1, nil)
	e.produce(t, topic,
		rec{id: "id-0", value: "ok"},
		rec{id: "bad-1", key: "k", value: "fail"},
		rec{id: "bad-2", value: "perm"},
		rec{value: "no id"},
		rec{id: "id-1", value: "ok"},
	)
	var attempts atomic.Int64
	p, err := consumer.New(e.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		attempts.Add(1)
		return e.handler("ledger")(ctx, tx, m)
	}, &consumer.Config{Schema: e.schema, MaxAttempts: 3, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	e.start(t, p, "g", topic)
	e.waitCommitted(t, "g", topic, 30*time.Second)
	e.exactlyOnce(t, "ledger", 2)
	if got := attempts.Load(); got != 1+3+1+1 {
		t.Errorf("handler calls = %d, want 6 (ok, 3× fail, 1× perm, ok)", got)
	}
	dead := e.k.ReadAll(t, topic+".dlq", 3, 20*time.Second)
	if len(dead) != 3 {
		t.Fatalf("dead letters = %d, want 3", len(dead))
	}
	want := []map[string]string{
		{consumer.HeaderDLQError: "always fails", consumer.HeaderDLQAttempts: "3", consumer.HeaderDLQOffset: "1", consumer.MessageIDHeader: "bad-1"},
		{consumer.HeaderDLQError: "permanent: cannot parse", consumer.HeaderDLQAttempts: "1", consumer.HeaderDLQOffset: "2", consumer.MessageIDHeader: "bad-2"},
		{consumer.HeaderDLQAttempts: "0", consumer.HeaderDLQOffset: "3"},
	}
	for i, r := range dead {
		h := headerMap(r)
		for k, v := range want[i] {
			if h[k] != v {
				t.Errorf("dead letter %d: header %s = %q, want %q", i, k, h[k], v)
			}
		}
		if h[consumer.HeaderDLQConsumer] != "ledger" || h[consumer.HeaderDLQTopic] != topic || h[consumer.HeaderDLQPartition] != "0" {
			t.Errorf("dead letter %d: origin headers %v", i, h)
		}
		if i == 2 && !containsStr(h[consumer.HeaderDLQError], "message-id") {
			t.Errorf("dead letter of a message without id: error %q does not name the header", h[consumer.HeaderDLQError])
		}
	}
	if string(dead[0].Key) != "k" || string(dead[0].Value) != "fail" {
		t.Errorf("dead letter 0 = %q/%q, want the original key and value", dead[0].Key, dead[0].Value)
	}
}

func containsStr(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}

// testMode runs 600 keyed messages over 3 partitions and checks each has
// one effect and each key's effects follow offset order.
func testMode(t *testing.T, a Adapter, mode string) {
	e := setup(t, a)
	topic := e.k.Topic(t, 3)
	const n = 600
	recs := make([]rec, n)
	for i := range recs {
		key := "k" + strconv.Itoa(i%12)
		recs[i] = rec{id: "id-" + strconv.Itoa(i), key: key, value: strconv.Itoa(i), partition: int32(i % 12 % 3)}
	}
	// A re-published message in the middle.
	recs = append(recs[:300:300], append([]rec{{id: "id-5", key: "k5", value: "5", partition: 2}}, recs[300:]...)...)
	e.produce(t, topic, recs...)
	var p *consumer.Processor
	var err error
	cfg := &consumer.Config{Schema: e.schema, Concurrency: 1}
	switch mode {
	case "small-queue":
		// Queues far smaller than a fetch: adapters must hold records
		// back (pause, or block) without losing or reordering any.
		cfg.QueueSize = 2
		p, err = consumer.New(e.pool, "ledger", e.handler("ledger"), cfg)
	case "queue-bytes":
		// The same, held back by bytes: a message here is 20 to 30
		// bytes (key, value and message-id header).
		cfg.QueueBytes = 100
		p, err = consumer.New(e.pool, "ledger", e.handler("ledger"), cfg)
	case "over-queue-bytes-key-parallel":
		cfg.Concurrency = 4
		fallthrough
	case "over-queue-bytes":
		// Every message larger than the bound: each is taken alone,
		// never stuck.
		cfg.QueueBytes = 1
		p, err = consumer.New(e.pool, "ledger", e.handler("ledger"), cfg)
	case "key-parallel":
		cfg.Concurrency = 4
		fallthrough
	case "in-order":
		p, err = consumer.New(e.pool, "ledger", e.handler("ledger"), cfg)
	case "queue-bytes-batch":
		cfg.QueueBytes = 200
		fallthrough
	case "batch":
		cfg.BatchSize = 50
		p, err = consumer.NewBatch(e.pool, "ledger", func(ctx context.Context, tx pgx.Tx, ms []consumer.Message) error {
			for _, m := range ms {
				if err := record(ctx, tx, e.effects, "ledger", m); err != nil {
					return err
				}
			}
			return nil
		}, cfg)
	}
	if err != nil {
		t.Fatal(err)
	}
	e.start(t, p, "g", topic)
	e.waitCommitted(t, "g", topic, 60*time.Second)
	e.exactlyOnce(t, "ledger", n)
	var unordered int
	err = e.pool.QueryRow(context.Background(), `SELECT count(*) FROM (
		SELECT off < lag(off) OVER (PARTITION BY key ORDER BY seq) AS back FROM `+e.effects+`) x WHERE back`).Scan(&unordered)
	if err != nil {
		t.Fatal(err)
	}
	if unordered != 0 {
		t.Fatalf("%d effects ran before an earlier message of their key", unordered)
	}
}

// testRebalance moves partitions between two members of a group while
// messages flow: every message has exactly one effect.
func testRebalance(t *testing.T, a Adapter) {
	e := setup(t, a)
	topic := e.k.Topic(t, 4)
	const n = 800
	produced := make(chan struct{})
	go func() {
		defer close(produced)
		for i := 0; i < n; i += 20 {
			batch := make([]rec, 20)
			for j := range batch {
				id := i + j
				batch[j] = rec{id: "id-" + strconv.Itoa(id), key: "k" + strconv.Itoa(id%16), value: strconv.Itoa(id), partition: int32(id % 4)}
			}
			e.produce(t, topic, batch...)
			time.Sleep(10 * time.Millisecond) // pace the producer so the rebalances happen mid-stream
		}
	}()
	stopA := e.start(t, e.processor(t, "ledger", nil), "g", topic)
	waitFor(t, 30*time.Second, "A to make progress", func() bool { return e.count(t, "") >= 100 })
	stopB := e.start(t, e.processor(t, "ledger", nil), "g", topic)
	waitFor(t, 30*time.Second, "progress with two members", func() bool { return e.count(t, "") >= 350 })
	stopA() // A leaves mid-stream: its partitions move to B
	<-produced
	e.waitCommitted(t, "g", topic, 60*time.Second)
	stopB()
	e.exactlyOnce(t, "ledger", n)
}

// testTransactions produces through a transactional producer, so the log
// holds commit markers between the records: they must not reach the handler
// (nor the dead-letter topic) and must not hold back the committed offset.
func testTransactions(t *testing.T, a Adapter) {
	e := setup(t, a)
	topic := e.k.Topic(t, 1)
	cl := e.k.Client(t, kgo.TransactionalID("tx-"+topic), kgo.DefaultProduceTopic(topic))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	id := 0
	for txn := range 3 {
		if err := cl.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			r := &kgo.Record{Value: []byte("tx"), Headers: []kgo.RecordHeader{{Key: consumer.MessageIDHeader, Value: []byte("id-" + strconv.Itoa(id))}}}
			id++
			if err := cl.ProduceSync(ctx, r).FirstErr(); err != nil {
				t.Fatal(err)
			}
		}
		if err := cl.EndTransaction(ctx, kgo.TryCommit); err != nil {
			t.Fatalf("commit transaction %d: %v", txn, err)
		}
	}
	e.produce(t, topic, rec{id: "id-6", value: "plain"})
	o := &outcomes{}
	e.start(t, e.processor(t, "ledger", &consumer.Config{Hooks: []consumer.Hook{o}}), "g", topic)
	e.waitCommitted(t, "g", topic, 30*time.Second)
	e.exactlyOnce(t, "ledger", 7)
	if o.dead.Load() != 0 {
		t.Fatalf("%d records dead-lettered: transaction markers were treated as messages", o.dead.Load())
	}
}

// testShutdownDrains cancels Run while a handler is in its transaction: the
// transaction finishes within the grace, and its offset is committed before
// Run returns.
func testShutdownDrains(t *testing.T, a Adapter) {
	e := setup(t, a)
	topic := e.k.Topic(t, 1)
	e.produce(t, topic, rec{id: "id-0", value: "a"})
	entered, release := make(chan struct{}), make(chan struct{})
	p, err := consumer.New(e.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		close(entered)
		<-release
		return record(ctx, tx, e.effects, "ledger", m)
	}, &consumer.Config{Schema: e.schema})
	if err != nil {
		t.Fatal(err)
	}
	stop := e.start(t, p, "g", topic)
	<-entered
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	select {
	case <-stopped:
		t.Fatal("Run returned while a transaction was in flight")
	case <-time.After(100 * time.Millisecond): // Run must still be draining: a negative check needs a bound
	}
	close(release)
	<-stopped
	e.exactlyOnce(t, "ledger", 1)
	if !e.committed(t, "g", topic) {
		t.Fatal("the drained message's offset was not committed at shutdown")
	}
}

// deadLetterFailures counts failed dead-letter publishes.
type deadLetterFailures struct{ all, missing atomic.Int64 }

func (d *deadLetterFailures) OnDeadLetterFailed(e consumer.DeadLetterFailedEvent) {
	d.all.Add(1)
	if e.TopicMissing {
		d.missing.Add(1)
	}
}

// errorLog counts Error records that name the dead-letter topic.
type errorLog struct {
	dlq string
	n   atomic.Int64
}

func (h *errorLog) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelError }
func (h *errorLog) Handle(_ context.Context, r slog.Record) error {
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "dlq" && a.Value.String() == h.dlq && strings.Contains(r.Message, "does not exist") {
			h.n.Add(1)
		}
		return true
	})
	return nil
}
func (h *errorLog) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *errorLog) WithGroup(string) slog.Handler      { return h }

// testDeadLetterTooLarge: a message the dead-letter topic cannot take (its
// max.message.bytes is smaller than the consumed topic's, or the dead
// letter's headers tip it over) must not stop its partition for good (G6):
// it is dead-lettered without its value, which a header measures, and the
// origin headers say where the original lies; the partition moves on.
func testDeadLetterTooLarge(t *testing.T, a Adapter) {
	e := setup(t, a)
	topic := e.k.Topic(t, 1)
	limit := "100000"
	e.k.CreateTopic(t, topic+".dlq", 1, map[string]*string{"max.message.bytes": &limit})
	big := make([]byte, 150_000)
	_, _ = rand.Read(big) // no codec takes it under the limit
	e.produce(t, topic, rec{id: "big", value: string(big)}, rec{id: "id-0", value: "ok"})
	p, err := consumer.New(e.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if len(m.Value) > 1000 {
			return consumer.Permanent(errors.New("too big to handle"))
		}
		return e.handler("ledger")(ctx, tx, m)
	}, &consumer.Config{Schema: e.schema})
	if err != nil {
		t.Fatal(err)
	}
	r := e.startWith(t, p, Options{}, "g", topic)
	e.waitCommitted(t, "g", topic, 60*time.Second)
	if err := r.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	e.exactlyOnce(t, "ledger", 1)
	dead := e.k.ReadAll(t, topic+".dlq", 1, 20*time.Second)
	if len(dead) != 1 {
		t.Fatalf("dead letters = %d, want 1", len(dead))
	}
	h := headerMap(dead[0])
	if dead[0].Value == nil || len(dead[0].Value) != 0 || h[consumer.HeaderDLQValueOmitted] != "150000" {
		t.Errorf("dead letter of %d value bytes (null %v), %s %q; want an empty value (a null one is a tombstone), and the original's size",
			len(dead[0].Value), dead[0].Value == nil, consumer.HeaderDLQValueOmitted, h[consumer.HeaderDLQValueOmitted])
	}
	if h[consumer.MessageIDHeader] != "big" || h[consumer.HeaderDLQTopic] != topic || h[consumer.HeaderDLQOffset] != "0" || h[consumer.HeaderDLQError] != "permanent: too big to handle" {
		t.Errorf("dead letter's headers %v, want its id, origin and error", h)
	}
}

// testMissingDeadLetterTopic: the dead-letter topic does not exist (and
// the broker does not create topics). The partition waits, loudly: an
// Error log and a HookDeadLetterFailed event per failed publish, nothing
// committed past the message. Once the topic exists the dead letter goes
// out and the partition moves on. With StopOnMissingDeadLetterTopic, Run
// returns an error wrapping consumer.ErrDeadLetterTopicMissing instead.
func testMissingDeadLetterTopic(t *testing.T, a Adapter) {
	for _, stopRun := range []bool{false, true} {
		t.Run("stop="+strconv.FormatBool(stopRun), func(t *testing.T) {
			e := setup(t, a)
			topic := e.k.Topic(t, 1)
			e.produce(t, topic, rec{id: "id-0", value: "ok"}, rec{id: "bad", value: "perm"}, rec{id: "id-1", value: "ok"})
			fails := &deadLetterFailures{}
			logs := &errorLog{dlq: topic + ".dlq"}
			p := e.processor(t, "ledger", &consumer.Config{Hooks: []consumer.Hook{fails}, Logger: slog.New(logs)})
			r := e.startWith(t, p, Options{StopOnMissingDeadLetterTopic: stopRun}, "g", topic)
			if stopRun {
				err := r.wait(90 * time.Second)
				if !errors.Is(err, consumer.ErrDeadLetterTopicMissing) {
					t.Fatalf("Run returned %v, want an error wrapping ErrDeadLetterTopicMissing", err)
				}
				if off := e.committedOffset(t, "g", topic, 0); off > 1 {
					t.Fatalf("committed offset %d, want at most 1: the undelivered dead letter's offset was committed", off)
				}
				e.exactlyOnce(t, "ledger", 1)
				return
			}
			waitFor(t, 90*time.Second, "failed dead-letter publishes reported as a missing topic", func() bool {
				return fails.missing.Load() >= 2 && logs.n.Load() >= 2
			})
			if off := e.committedOffset(t, "g", topic, 0); off > 1 {
				t.Fatalf("committed offset %d while the dead letter is not published, want at most 1", off)
			}
			e.k.CreateTopic(t, topic+".dlq", 1, nil)
			e.waitCommitted(t, "g", topic, 90*time.Second)
			if err := r.stop(); err != nil {
				t.Fatalf("Run: %v", err)
			}
			e.exactlyOnce(t, "ledger", 2)
			if dead := e.k.ReadAll(t, topic+".dlq", 1, 20*time.Second); len(dead) != 1 {
				t.Fatalf("dead letters = %d, want 1", len(dead))
			}
		})
	}
}

// testForbiddenDeadLetterTopic: the dead-letter topic exists but the
// consumer may not describe or write it (an ACL not granted yet: Kafka
// leaves it out of all-topics Metadata and refuses the produce with
// TOPIC_AUTHORIZATION_FAILED; the fault, without Keys, does both). The
// partition waits as for any failed publish, but the topic is not missing:
// no failure says TopicMissing, and StopOnMissingDeadLetterTopic does not
// stop Run with ErrDeadLetterTopicMissing.
func testForbiddenDeadLetterTopic(t *testing.T, a Adapter) {
	e := setup(t, a)
	fake := e.k.RequireFake(t)
	topic := e.k.Topic(t, 1)
	e.k.CreateTopic(t, topic+".dlq", 1, nil)
	h := fake.Fault(kfake.Fault{Topic: topic + ".dlq", Err: kerr.TopicAuthorizationFailed, Count: -1})
	defer h.Remove()
	e.produce(t, topic, rec{id: "bad", value: "perm"})
	fails := &deadLetterFailures{}
	p := e.processor(t, "ledger", &consumer.Config{Hooks: []consumer.Hook{fails}})
	r := e.startWith(t, p, Options{StopOnMissingDeadLetterTopic: true}, "g", topic)
	waitFor(t, 90*time.Second, "a failed dead-letter publish", func() bool { return fails.all.Load() >= 1 })
	if n := fails.missing.Load(); n != 0 {
		t.Errorf("%d of %d failed publishes to an existing but forbidden dead-letter topic reported it missing", n, fails.all.Load())
	}
	waitFor(t, 90*time.Second, "a second failed dead-letter publish, or Run to stop", func() bool {
		return fails.all.Load() >= 2 || len(r.done) > 0
	})
	select {
	case err := <-r.done:
		r.once.Do(func() { r.err = err })
		t.Fatalf("Run stopped, the dead-letter topic being forbidden, not missing: %v", err)
	default:
	}
}

// testDeadLetterRetriedByTheClient: the dead-letter topic answers a
// retriable error for as long as it lasts (NOT_ENOUGH_REPLICAS: too few
// replicas in sync for the topic's min.insync.replicas). franz-go retried
// such a produce for ever, inside one PublishDeadLetter call, so the
// partition waited with no failed publish counted and no alert (helper
// 83). A dead-letter publish is bounded: the failure is reported, the
// partition waits, retrying, and goes on once the topic takes writes.
func testDeadLetterRetriedByTheClient(t *testing.T, a Adapter) {
	e := setup(t, a)
	fake := e.k.RequireFake(t)
	topic := e.k.Topic(t, 1)
	e.k.CreateTopic(t, topic+".dlq", 1, nil)
	h := fake.Fault(kfake.Fault{Topic: topic + ".dlq", Err: kerr.NotEnoughReplicas, Count: -1})
	e.produce(t, topic, rec{id: "bad", value: "perm"}, rec{id: "id-0", value: "ok"})
	fails := &deadLetterFailures{}
	p := e.processor(t, "ledger", &consumer.Config{Hooks: []consumer.Hook{fails}})
	stop := e.start(t, p, "g", topic)
	waitFor(t, 90*time.Second, "a failed dead-letter publish reported", func() bool { return fails.all.Load() >= 1 })
	if off := e.committedOffset(t, "g", topic, 0); off > 0 {
		t.Fatalf("committed offset %d while the dead letter is not published, want 0", off)
	}
	h.Remove()
	e.waitCommitted(t, "g", topic, 90*time.Second)
	stop()
	e.exactlyOnce(t, "ledger", 1)
	if dead := e.k.ReadAll(t, topic+".dlq", 1, 20*time.Second); len(dead) < 1 {
		t.Fatalf("dead letters = %d, want the one", len(dead))
	}
}
