package relay_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// stagingPublisher acknowledges every event but the one of key "k", which
// it answers "unknown topic", then (its second attempt) an outage, then
// "unknown topic" again; it notes when. It stages the rounds around that
// outage so that the key's retry comes due while the outage's record is
// still being written:
//
//   - on "a" (round A, the one after k's first) it locks a's row, which
//     holds up A's record, and writes x1..x4 (the rounds after it); it
//     answers 300 ms late, so that k's retry is due at the next read
//     (round B, [k, x1]);
//   - on k's outage (round B) it locks k's row, which holds up B's record
//     (the outage), and lets a's row go 800 ms later (B's end waits for
//     A's record until then, past k's next backoff) and k's row 400 ms
//     after that.
//
// With timeout, the outage is a publish timeout (k goes to the side
// retry); otherwise a passing error (k's retry is a round's).
type stagingPublisher struct {
	t       *testing.T
	b       *bundle
	table   string
	timeout bool
	lockA   *pgx.Conn
	lockK   *pgx.Conn

	mu      sync.Mutex
	kCalls  []time.Time
	againAt time.Time // first "unknown topic" after the outage
	freed   chan struct{}
	wg      sync.WaitGroup // the goroutines that let the locks go
}

func (p *stagingPublisher) Publish(ctx context.Context, records []relay.Record) []error {
	errs := make([]error, len(records))
	for i, rec := range records {
		switch string(rec.Key) {
		case "a":
			p.mu.Lock()
			staged := p.freed != nil
			p.mu.Unlock()
			if staged {
				continue
			}
			tx := p.lock(p.lockA, "a")
			p.write("x1", "x2", "x3", "x4")
			time.Sleep(300 * time.Millisecond)
			p.mu.Lock()
			p.freed = make(chan struct{})
			p.mu.Unlock()
			p.wg.Add(1)
			go func(freed chan struct{}) {
				defer p.wg.Done()
				select {
				case <-freed:
				case <-time.After(5 * time.Second): // off script: no wait forever
				}
				_ = tx.Rollback(context.Background())
			}(p.freed)
		case "k":
			errs[i] = p.answerK(ctx)
		}
	}
	return errs
}

func (p *stagingPublisher) answerK(ctx context.Context) error {
	p.mu.Lock()
	n := len(p.kCalls)
	p.kCalls = append(p.kCalls, time.Now())
	if n > 1 && p.againAt.IsZero() {
		p.againAt = p.kCalls[n]
	}
	freedA := p.freed
	p.mu.Unlock()
	unknown := fmt.Errorf("%w: UNKNOWN_TOPIC_OR_PARTITION", relay.ErrUnknownTopic)
	switch n {
	case 0:
		return unknown
	case 1:
		tx := p.lock(p.lockK, "k")
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			time.Sleep(800 * time.Millisecond)
			if freedA != nil {
				close(freedA)
			}
			time.Sleep(400 * time.Millisecond)
			_ = tx.Rollback(context.Background())
		}()
		if p.timeout {
			<-ctx.Done()
		}
		return errors.New("broker down")
	}
	return unknown
}

// lock takes a row lock on the events of key in a transaction it returns.
func (p *stagingPublisher) lock(conn *pgx.Conn, key string) pgx.Tx {
	ctx := context.Background()
	tx, err := conn.Begin(ctx)
	if err == nil {
		_, err = tx.Exec(ctx, `SELECT 1 FROM `+p.table+` WHERE key = $1 FOR UPDATE`, []byte(key))
	}
	if err != nil {
		p.t.Error(err)
	}
	return tx
}

func (p *stagingPublisher) write(keys ...string) {
	var msgs []outbox.Message
	for _, k := range keys {
		msgs = append(msgs, outbox.Message{Topic: "t", Key: []byte(k), Value: []byte(k)})
	}
	if err := pgx.BeginFunc(context.Background(), p.b.pool, func(tx pgx.Tx) error {
		return p.b.writer.Write(context.Background(), tx, msgs...)
	}); err != nil {
		p.t.Error(err)
	}
}

func (p *stagingPublisher) Close() error { return nil }

// A key whose retry comes due while its last failure (an outage) is still
// being recorded is retried with that failure recorded, whichever read
// brings its event back: read before, the event would carry the refusal
// run the outage ended (unknown topic since long ago) and be
// dead-lettered at the next "unknown topic" instead of after a fresh grace
// (G7). TestARetryDueWhileItsFailureIsRecordedReadsTheRecordedRow covers a
// fresh read; here the retry is read ahead (a full round's next round, read
// while that round is with Kafka) or by the side retry (after a publish
// timeout). The stagingPublisher holds the records up with row locks.
func TestARetryDueWhileItsFailureIsRecordedIsNotReadStale(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		timeout bool
	}{
		{"read ahead", false},
		{"side retry", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			// The first round is [k, y], and [a] is read ahead while it is
			// with Kafka.
			b.write(t, outbox.Message{Topic: "gone", Key: []byte("k"), Value: []byte("k")},
				outbox.Message{Topic: "t", Key: []byte("y"), Value: []byte("y")},
				outbox.Message{Topic: "t", Key: []byte("a"), Value: []byte("a")})
			pub := &stagingPublisher{
				t: t, b: b, table: pgx.Identifier{b.schema, "outbox"}.Sanitize(), timeout: tc.timeout,
				lockA: pgtest.Conn(t), lockK: pgtest.Conn(t),
			}
			t.Cleanup(pub.wg.Wait) // before the connections close
			const grace = 500 * time.Millisecond
			b.startRelayWith(t, b.pool, pub, relay.Config{
				BatchSize: 2, UnknownTopicGrace: grace, MaxRetryBackoff: 200 * time.Millisecond,
				PublishTimeout: 200 * time.Millisecond,
			})
			waitFor(t, "k to be dead-lettered", 30*time.Second, func() bool { return b.count(t, "outbox_dead") == 1 })
			waitFor(t, "the other events to be published", 10*time.Second, func() bool { return b.count(t, "outbox") == 0 })
			var key []byte
			var msg string
			if err := b.pool.QueryRow(context.Background(), `SELECT key, error FROM `+pgx.Identifier{b.schema, "outbox_dead"}.Sanitize()).Scan(&key, &msg); err != nil {
				t.Fatal(err)
			}
			pub.mu.Lock()
			defer pub.mu.Unlock()
			if string(key) != "k" || len(pub.kCalls) < 3 {
				t.Fatalf("dead-lettered key %q (%s) after %d attempts of k, want k after at least 3", key, msg, len(pub.kCalls))
			}
			last := pub.kCalls[len(pub.kCalls)-1]
			if last.Sub(pub.againAt) < grace*8/10 {
				t.Fatalf("dead-lettered %s after the first unknown-topic answer that followed the outage (k answered at %v); the grace (%s) counts from there",
					last.Sub(pub.againAt), pub.kCalls, grace)
			}
		})
	}
}
