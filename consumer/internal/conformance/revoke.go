package conformance

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

// testRebalanceWithStuckHandler: member A's handler is stuck on partition
// 0's first message when member B joins the group. The rebalance must not
// wait for the stuck handler: partition 1 keeps being processed (by A or
// B) within a bounded time, and goes on doing so; no committed offset ever
// passes a message that has not been processed; once the handler is
// released, the stuck message has exactly one effect and one dedup record.
//
// With honour, the stuck handler returns when its ctx is canceled (a slow
// call or a lock that takes a ctx); without, it ignores its ctx (a lock
// that takes none) and returns only once released.
func testRebalanceWithStuckHandler(t *testing.T, a Adapter, o Options, honour bool) {
	e := setup(t, a)
	topic := e.k.Topic(t, 2)
	const perPartition = 20
	var recs []rec
	recs = append(recs, rec{id: "stuck", value: "stuck", partition: 0})
	for i := range perPartition {
		recs = append(recs, rec{id: "p0-" + strconv.Itoa(i), value: "x", partition: 0})
	}
	p1 := 0 // messages produced to partition 1 so far
	produceP1 := func() {
		recs := make([]rec, perPartition)
		for i := range recs {
			recs[i] = rec{id: "p1-" + strconv.Itoa(p1+i), value: "x", partition: 1}
		}
		e.produce(t, topic, recs...)
		p1 += perPartition
	}
	e.produce(t, topic, recs...)
	produceP1()

	release := make(chan struct{})
	var releaseOnce sync.Once
	releaseAll := func() { releaseOnce.Do(func() { close(release) }) }
	entered := make(chan struct{}, 1)
	var entries, canceled atomic.Int64
	newProcessor := func() *consumer.Processor {
		p, err := consumer.New(e.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
			if string(m.Value) == "stuck" {
				entries.Add(1)
				select {
				case entered <- struct{}{}:
				default:
				}
				if honour {
					select {
					case <-release:
					case <-ctx.Done():
						canceled.Add(1)
						return ctx.Err()
					}
				} else {
					<-release
				}
			}
			return record(ctx, tx, e.effects, "ledger", m)
		}, &consumer.Config{Schema: e.schema, MinBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}

	watch, stopWatch := e.watchProcessedPrefix(t, "g", topic, 2)
	stopA := e.startOpts(t, newProcessor(), o, "g", topic)
	t.Cleanup(releaseAll) // runs before the consumers are stopped
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the stuck message never reached the handler")
	}
	e.waitOffset(t, "g", topic, 1, int64(p1), 30*time.Second, "partition 1 processed by A alone")

	// B joins: a rebalance while A's handler is stuck.
	start := time.Now()
	stopB := e.startOpts(t, newProcessor(), o, "g", topic)
	// A is not evicted for being late: the group settles with both
	// members, each owning a partition.
	e.waitGroupShared(t, "g", topic, 2, 30*time.Second, "the group to settle with A and B after B joined")
	// Partition 1 keeps flowing after the rebalance, and keeps flowing
	// for a while (a member evicted for rejoining late rebalances the
	// group again when it comes back).
	var worst time.Duration
	for round := 0; round < 3 || time.Since(start) < 15*time.Second; round++ {
		produceP1()
		began := time.Now()
		e.waitOffset(t, "g", topic, 1, int64(p1), 30*time.Second,
			fmt.Sprintf("partition 1 processed after B joined (round %d, A's handler stuck)", round))
		took := time.Since(began)
		worst = max(worst, took)
		t.Logf("round %d: partition 1 committed to %d in %v, %v after B started", round, p1, took.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
		select {
		case <-time.After(500 * time.Millisecond):
		case <-t.Context().Done():
		}
	}
	t.Logf("partition 1: slowest round %v", worst.Round(time.Millisecond))
	e.waitGroupShared(t, "g", topic, 2, 30*time.Second, "the group to stay shared by A and B while A's handler is stuck")
	if n := e.count(t, "message_id = 'stuck'"); n != 0 {
		t.Fatalf("the stuck message has %d effects while its handler is stuck", n)
	}
	if eager := o.Eager || !a.Cooperative; eager && honour && canceled.Load() == 0 {
		t.Fatalf("A's stuck handler was not canceled though the rebalance revoked its partition")
	}

	releaseAll()
	e.waitCommitted(t, "g", topic, 60*time.Second)
	stopB()
	stopA()
	stopWatch()
	t.Logf("stuck handler entered %d times, canceled %d times", entries.Load(), canceled.Load())

	want := []string{"stuck"}
	for i := range perPartition {
		want = append(want, "p0-"+strconv.Itoa(i))
	}
	for i := range p1 {
		want = append(want, "p1-"+strconv.Itoa(i))
	}
	e.exactlyOnceIDs(t, "ledger", want)
	var dedup int
	if err := e.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{e.schema, "processed_messages"}.Sanitize()+
		` WHERE consumer = 'ledger' AND message_id = 'stuck'`).Scan(&dedup); err != nil {
		t.Fatal(err)
	}
	if dedup != 1 {
		t.Fatalf("dedup records of the stuck message = %d, want 1", dedup)
	}
	if v := watch.violations(); len(v) > 0 {
		t.Fatalf("offsets committed past unprocessed messages: %v", head(v))
	}
}

// waitOffset waits until group's committed offset of one partition is at
// least want.
func (e *env) waitOffset(t *testing.T, group, topic string, partition int32, want int64, timeout time.Duration, what string) {
	t.Helper()
	adm := e.k.Admin(t)
	waitFor(t, timeout, what, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		offs, err := adm.FetchOffsets(ctx, e.group(group))
		if err != nil {
			return false
		}
		o, ok := offs.Lookup(topic, partition)
		return ok && o.At >= want
	})
}

// waitGroupShared waits until group is stable with members members, each
// assigned a partition of topic.
func (e *env) waitGroupShared(t *testing.T, group, topic string, members int, timeout time.Duration, what string) {
	t.Helper()
	adm := e.k.Admin(t)
	var last string
	defer func() {
		if t.Failed() {
			t.Logf("group %s last described as %s", group, last)
		}
	}()
	waitFor(t, timeout, what, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		gs, err := adm.DescribeGroups(ctx, e.group(group))
		if err != nil {
			last = err.Error()
			return false
		}
		g, ok := gs[e.group(group)]
		if ok {
			last = fmt.Sprintf("state %s, %d members, protocol %s, err %v", g.State, len(g.Members), g.Protocol, g.Err)
		}
		if !ok || g.Err != nil || g.State != "Stable" || len(g.Members) != members {
			return false
		}
		for _, m := range g.Members {
			c, ok := m.Assigned.AsConsumer()
			if !ok {
				return false
			}
			n := 0
			for _, tp := range c.Topics {
				if tp.Topic == topic {
					n += len(tp.Partitions)
				}
			}
			if n == 0 {
				return false
			}
		}
		return true
	})
}

// prefixWatch polls a group's committed offsets and remembers every one
// that passed a message without an effect.
type prefixWatch struct {
	mu   sync.Mutex
	errs []string
}

func (w *prefixWatch) violations() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.errs
}

// watchProcessedPrefix checks, as the group commits, that every message
// below a partition's committed offset has its effect: the offset is read
// first, then the effects, which committed before the offset did.
func (e *env) watchProcessedPrefix(t *testing.T, group, topic string, partitions int32) (*prefixWatch, func()) {
	w := &prefixWatch{}
	adm := e.k.Admin(t)
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		for {
			select {
			case <-done:
				return
			case <-time.After(20 * time.Millisecond):
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			offs, err := adm.FetchOffsets(ctx, e.group(group))
			if err != nil {
				cancel()
				continue
			}
			for p := range partitions {
				o, ok := offs.Lookup(topic, p)
				if !ok || o.At <= 0 {
					continue
				}
				var n int64
				if err := e.pool.QueryRow(ctx, `SELECT count(DISTINCT off) FROM `+e.effects+` WHERE part = $1 AND off < $2`, p, o.At).Scan(&n); err != nil {
					continue
				}
				if n != o.At {
					w.mu.Lock()
					w.errs = append(w.errs, fmt.Sprintf("partition %d committed at %d with %d of the messages below processed", p, o.At, n))
					w.mu.Unlock()
				}
			}
			cancel()
		}
	}()
	var once sync.Once
	stop := func() { once.Do(func() { close(done); <-stopped }) }
	t.Cleanup(stop)
	return w, stop
}

// exactlyOnceIDs checks that each of ids has exactly one effect for
// consumer name, and nothing else has one.
func (e *env) exactlyOnceIDs(t *testing.T, name string, ids []string) {
	t.Helper()
	rows, err := e.pool.Query(context.Background(), `SELECT message_id, count(*) FROM `+e.effects+` WHERE consumer = $1 GROUP BY 1`, name)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			t.Fatal(err)
		}
		seen[id] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	var missing, doubled []string
	for _, id := range ids {
		switch c := seen[id]; {
		case c == 0:
			missing = append(missing, id)
		case c > 1:
			doubled = append(doubled, fmt.Sprintf("%s×%d", id, c))
		}
	}
	if len(missing) > 0 || len(doubled) > 0 || len(seen) != len(ids) {
		t.Fatalf("effects not exactly once: %d distinct of %d; missing %v; repeated %v", len(seen), len(ids), head(missing), head(doubled))
	}
}
