package consumer_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
)

// bundle is what a core test needs: a migrated schema with an effects
// table, where handlers record what they did.
type bundle struct {
	pool    *pgxpool.Pool
	schema  string
	effects string // effects(message_id, consumer, n)
}

func setup(t *testing.T) *bundle {
	t.Helper()
	t.Parallel()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := pool.Exec(context.Background(), `CREATE TABLE `+effects+` (message_id text, consumer text, note text)`); err != nil {
		t.Fatal(err)
	}
	return &bundle{pool: pool, schema: schema, effects: effects}
}

// record is a handler effect: one row per run that committed.
func (b *bundle) record(ctx context.Context, tx pgx.Tx, name string, msg consumer.Message) error {
	_, err := tx.Exec(ctx, `INSERT INTO `+b.effects+` (message_id, consumer, note) VALUES ($1, $2, $3)`, msg.ID, name, string(msg.Value))
	return err
}

func (b *bundle) count(t *testing.T, where string, args ...any) int {
	t.Helper()
	var n int
	q := `SELECT count(*) FROM ` + b.effects
	if where != "" {
		q += ` WHERE ` + where
	}
	if err := b.pool.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func (b *bundle) processedRows(t *testing.T, name string) int {
	t.Helper()
	var n int
	q := `SELECT count(*) FROM ` + pgx.Identifier{b.schema, "processed_messages"}.Sanitize() + ` WHERE consumer = $1`
	if err := b.pool.QueryRow(context.Background(), q, name).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// ownPool returns a pool of the test's own, configured by configure, so
// the test can trace its queries or tamper with its sessions and see that
// it holds no connection at the end.
func ownPool(t *testing.T, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	configure(cfg)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Close waits for every connection to come back: a test that
		// found one kept has failed already and must not hang here.
		if pool.Stat().AcquiredConns() == 0 {
			pool.Close()
		}
	})
	return pool
}

// memTransport records marks and dead letters in memory: the core tests
// exercise PostgreSQL for real and leave Kafka to the adapter tests.
type memTransport struct {
	mu      sync.Mutex
	marks   []int64
	dead    []consumer.DeadLetter
	failDLQ int // fail this many publishes first
}

func (m *memTransport) MarkDone(msg consumer.Message) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.marks = append(m.marks, msg.Offset)
}

func (m *memTransport) PublishDeadLetter(_ context.Context, d consumer.DeadLetter) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.failDLQ > 0 {
		m.failDLQ--
		return fmt.Errorf("broker unavailable")
	}
	m.dead = append(m.dead, d)
	return nil
}

func (m *memTransport) lastMark() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.marks) == 0 {
		return -1
	}
	return m.marks[len(m.marks)-1]
}

func (m *memTransport) deadLetters() []consumer.DeadLetter {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]consumer.DeadLetter(nil), m.dead...)
}

// waitFor polls cond until it holds or the timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func msg(offset int64, id string, key string) consumer.Message {
	m := consumer.Message{Topic: "orders", Partition: 0, Offset: offset, Value: []byte(fmt.Sprintf("v%d", offset))}
	if key != "" {
		m.Key = []byte(key)
	}
	if id != "" {
		m.Headers = []consumer.Header{{Key: outbox.MessageIDHeader, Value: []byte(id)}}
	}
	return m
}

// run feeds msgs through one partition and waits until the last is marked
// done.
func run(t *testing.T, p *consumer.Processor, tr *memTransport, msgs ...consumer.Message) {
	t.Helper()
	w := start(t, p, tr, msgs...)
	defer w.Stop(context.Background())
	last := msgs[len(msgs)-1].Offset
	waitFor(t, 30*time.Second, fmt.Sprintf("offset %d marked done", last), func() bool { return tr.lastMark() == last })
}

// start starts a partition of p on tr and queues msgs; the caller stops it.
func start(t *testing.T, p *consumer.Processor, tr consumer.Transport, msgs ...consumer.Message) *consumer.Partition {
	t.Helper()
	ctx := context.Background()
	w := p.StartPartition(ctx, tr)
	if err := w.Add(ctx, msgs...); err != nil {
		w.Stop(ctx)
		t.Fatal(err)
	}
	return w
}

type counter struct {
	mu       sync.Mutex
	outcomes map[consumer.Outcome]int
	retries  int
	dead     int
}

func (c *counter) OnDone(e consumer.DoneEvent) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.outcomes == nil {
		c.outcomes = map[consumer.Outcome]int{}
	}
	c.outcomes[e.Outcome]++
}

func (c *counter) OnRetry(consumer.RetryEvent) { c.mu.Lock(); c.retries++; c.mu.Unlock() }

func (c *counter) OnDeadLetter(consumer.DeadLetterEvent) { c.mu.Lock(); c.dead++; c.mu.Unlock() }

func (c *counter) get(o consumer.Outcome) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.outcomes[o]
}

// redeliver hands m again to a new "ledger" Processor on b's pool, as Kafka
// does after a rebalance, and returns its transport and partition.
func redeliver(t *testing.T, b *bundle, m consumer.Message) (*memTransport, *consumer.Partition) {
	t.Helper()
	p, err := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	return tr, start(t, p, tr, m)
}

// newLedgerProcessor builds the "ledger" consumer that runs handle per
// message, or, with batch, for each message of a batch in one transaction.
func newLedgerProcessor(t *testing.T, pool *pgxpool.Pool, batch bool, handle consumer.Handler, cfg *consumer.Config) *consumer.Processor {
	t.Helper()
	var p *consumer.Processor
	var err error
	if batch {
		p, err = consumer.NewBatch(pool, "ledger", func(ctx context.Context, tx pgx.Tx, ms []consumer.Message) error {
			for _, m := range ms {
				if err := handle(ctx, tx, m); err != nil {
					return err
				}
			}
			return nil
		}, cfg)
	} else {
		p, err = consumer.New(pool, "ledger", handle, cfg)
	}
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// oneConn is a single connection of its own (one session) for a test that
// gives the Processor a *pgx.Conn; closed at the test's end.
func oneConn(t *testing.T) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// inBothModes runs f as a subtest per message ("per-message") and in batch
// mode ("batch").
func inBothModes(t *testing.T, f func(t *testing.T, batch bool)) {
	for _, batch := range []bool{false, true} {
		name := "per-message"
		if batch {
			name = "batch"
		}
		t.Run(name, func(t *testing.T) { f(t, batch) })
	}
}
