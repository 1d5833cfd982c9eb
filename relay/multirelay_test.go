package relay_test

import (
	"context"
	"fmt"
	"hash/fnv"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/relay"
)

// mrGate holds a relay incarnation's database statements (paused) or fails
// them at once (dead: a crashed process).
type mrGate struct {
	mu   sync.Mutex
	open chan struct{} // closed: statements pass
	dead atomic.Bool
	slow atomic.Int64 // max random delay per statement, ns
	// stallNext, if > 0, holds the next statement for that long (ns) while
	// the others pass: one connection stalls.
	stallNext atomic.Int64
}

func newGate() *mrGate {
	g := &mrGate{open: make(chan struct{})}
	close(g.open)
	return g
}

func (g *mrGate) pause() {
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-g.open:
		g.open = make(chan struct{})
	default:
	}
}

func (g *mrGate) resume() {
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-g.open:
	default:
		close(g.open)
	}
}

var deadCtx = func() context.Context {
	c, cancel := context.WithCancel(context.Background())
	cancel()
	return c
}()

func (g *mrGate) pass(ctx context.Context) context.Context {
	if g.dead.Load() {
		return deadCtx
	}
	if s := g.slow.Load(); s > 0 {
		time.Sleep(time.Duration(rand.Int64N(s)))
	}
	if d := g.stallNext.Swap(0); d > 0 {
		t := time.NewTimer(time.Duration(d))
		select {
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
	}
	g.mu.Lock()
	c := g.open
	g.mu.Unlock()
	select {
	case <-c:
	case <-ctx.Done():
	}
	if g.dead.Load() {
		return deadCtx
	}
	return ctx
}

type mrTracer struct{ g *mrGate }

func (t mrTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return t.g.pass(ctx)
}
func (t mrTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return t.g.pass(ctx)
}
func (mrTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (mrTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}
func (mrTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData)     {}

// mrCore is "Kafka": it records each value's first publication (in the
// order the calls reach it) and fails records at random.
type mrCore struct {
	mu       sync.Mutex
	rng      *rand.Rand
	failP    float64
	lostAckP float64 // the record is written, the answer is an error
	acked    []string
	seen     map[string]bool
	calls    int
	// refuseEvery > 0 refuses for good (as too large) one value in about
	// that many, for refuseFor from its first refusal (a topic's limit
	// raised then): the relay dead-letters it, unless it is accepted
	// first, its dead letter lost.
	refuseEvery uint32
	refuseFor   time.Duration
	refusedAt   map[string]time.Time
}

// refusable reports whether v is one of the values refused for good.
func refusable(v string, every uint32) bool {
	if every == 0 {
		return false
	}
	h := fnv.New32a()
	h.Write([]byte(v))
	return h.Sum32()%every == 0
}

func (c *mrCore) refuses(v string) bool {
	if !refusable(v, c.refuseEvery) {
		return false
	}
	at, ok := c.refusedAt[v]
	if !ok {
		at = time.Now()
		c.refusedAt[v] = at
	}
	return time.Since(at) < c.refuseFor
}

func (c *mrCore) publish(records []relay.Record) []error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls++
	return publishLikeAPartition(records, func(r relay.Record) (err error, written bool) {
		if c.refuses(string(r.Value)) {
			return relay.ErrRecordTooLarge, false
		}
		if c.rng.Float64() < c.failP {
			return errNotEnoughReplicas, c.rng.Float64() < c.lostAckP
		}
		return nil, true
	}, func(v string) {
		if !c.seen[v] {
			c.seen[v] = true
			c.acked = append(c.acked, v)
		}
	})
}

// mrPub is one relay incarnation's publisher: it can be paused (calls wait
// until resumed or their deadline: a timeout, nothing written) or dead.
type mrPub struct {
	core *mrCore
	g    *mrGate
}

func (p *mrPub) Publish(ctx context.Context, records []relay.Record) []error {
	if !p.g.dead.Load() {
		p.g.mu.Lock()
		c := p.g.open
		p.g.mu.Unlock()
		select {
		case <-c:
		case <-ctx.Done():
		}
	}
	if p.g.dead.Load() || ctx.Err() != nil {
		errs := make([]error, len(records))
		for i := range errs {
			errs[i] = fmt.Errorf("not acknowledged: %w", context.DeadlineExceeded)
		}
		return errs
	}
	return p.core.publish(records)
}

func (p *mrPub) Close() error { return nil }

func (p *mrPub) Partition(topic string, key []byte) (int32, bool) {
	h := fnv.New32a()
	h.Write([]byte(topic))
	h.Write(key)
	return int32(h.Sum32() % 4), true
}

type mrMode struct {
	relays   int
	batch    int
	heldKeys int
	topics   int
	failP    float64
	chaos    time.Duration
	refuse   uint32 // see mrCore.refuseEvery
}

type mrIncarnation struct {
	id     string
	dbGate *mrGate
	pubGt  *mrGate
	cancel context.CancelFunc
	done   chan struct{}
	pool   *pgxpool.Pool
}

// Several relays with short leases against one outbox, while relays are
// paused (database and/or broker, past their lease), crash (a frozen
// process: nothing it sends arrives any more) and restart under their id,
// freeze while a successor takes their id and then resume, have one
// connection's statement stall while the others go on,
// stop gracefully and come back, and publishers time out (side retries,
// sick partitions) or fail at random (some after writing the record).
// Each key's first publications come in write order (G3) and every
// event is published once everything heals (G2).
func TestMultiRelayChaosKeepsKeyOrderAndDrains(t *testing.T) {
	t.Parallel()
	seeds := 1
	if n, err := strconv.Atoi(os.Getenv("ONCEFLOW_RANDOM_SEEDS")); err == nil && n > 0 {
		seeds = n
	}
	first := 0
	if n, err := strconv.Atoi(os.Getenv("ONCEFLOW_FIRST_SEED")); err == nil {
		first = n
	}
	modes := map[string]mrMode{
		"three":         {relays: 3, batch: 10, failP: 0.03, topics: 1, chaos: 6 * time.Second},
		"three-ceiling": {relays: 3, batch: 10, heldKeys: 3, failP: 0.06, topics: 1, chaos: 6 * time.Second},
		"two-topics":    {relays: 2, batch: 20, failP: 0.03, topics: 2, chaos: 6 * time.Second},
		"dead-letters":  {relays: 3, batch: 10, failP: 0.03, topics: 2, chaos: 6 * time.Second, refuse: 40},
	}
	only := os.Getenv("ONCEFLOW_MR_MODE")
	for name, m := range modes {
		if only != "" && only != name {
			continue
		}
		for seed := first; seed < first+seeds; seed++ {
			t.Run(fmt.Sprintf("%s seed %d", name, seed), func(t *testing.T) {
				multiRelayRun(t, m, uint64(seed))
			})
		}
	}
}

func multiRelayRun(t *testing.T, m mrMode, seed uint64) {
	ctx := context.Background()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	shardsT := pgx.Identifier{schema, "relay_shards"}.Sanitize()
	rng := rand.New(rand.NewPCG(seed, 7))
	core := &mrCore{rng: rand.New(rand.NewPCG(seed, 11)), failP: m.failP, lostAckP: 0.3, seen: map[string]bool{},
		refuseEvery: m.refuse, refuseFor: 30 * time.Millisecond, refusedAt: map[string]time.Time{}}
	if m.refuse > 0 {
		// A third of the dead letters fail (a database failing over), so
		// some refused events are still pending when their refusal heals.
		q := func(name string) string { return pgx.Identifier{schema, name}.Sanitize() }
		for _, s := range []string{
			`CREATE FUNCTION ` + q("fail_some_dead_letters") + `() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF random() < 0.3 THEN
        RAISE EXCEPTION 'injected: the dead letter failed';
    END IF;
    RETURN NEW;
END $$`,
			`CREATE TRIGGER fail_some_dead_letters BEFORE INSERT ON ` + q("outbox_dead") + ` FOR EACH ROW EXECUTE FUNCTION ` + q("fail_some_dead_letters") + `()`,
		} {
			if _, err := pool.Exec(ctx, s); err != nil {
				t.Fatal(err)
			}
		}
	}
	lease := 600 * time.Millisecond
	cfg := relay.Config{Schema: schema, BatchSize: m.batch, PollInterval: 20 * time.Millisecond,
		LeaseDuration: lease, MaxRetryBackoff: 100 * time.Millisecond, MaxHeldKeys: m.heldKeys, PublishTimeout: 200 * time.Millisecond}

	var mu sync.Mutex
	live := map[string]*mrIncarnation{}
	var all []*mrIncarnation
	var bg sync.WaitGroup
	start := func(id string) {
		g, pg := newGate(), newGate()
		p := pgtest.TracedPool(t, mrTracer{g}, 6)
		c := cfg
		c.InstanceID = id
		if os.Getenv("ONCEFLOW_MR_LOG") != "" {
			c.Logger = slog.New(slog.NewTextHandler(&tlogWriter{t: t, id: id}, &slog.HandlerOptions{Level: slog.LevelInfo}))
		}
		r, err := relay.New(p, &mrPub{core: core, g: pg}, &c)
		if err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		inc := &mrIncarnation{id: id, dbGate: g, pubGt: pg, cancel: cancel, done: make(chan struct{}), pool: p}
		go func() {
			defer close(inc.done)
			if err := r.Run(rctx); err != nil {
				t.Logf("relay %s: Run: %v", id, err)
			}
		}()
		mu.Lock()
		live[id] = inc
		all = append(all, inc)
		mu.Unlock()
	}
	for i := range m.relays {
		start("r" + strconv.Itoa(i))
	}

	// Shard moves, sampled.
	var moves atomic.Int64
	var sampling sync.WaitGroup
	stopSample := make(chan struct{})
	sampling.Add(1)
	go func() {
		defer sampling.Done()
		prev := map[int16]string{}
		for {
			select {
			case <-stopSample:
				return
			case <-time.After(30 * time.Millisecond):
			}
			rows, err := pool.Query(ctx, `SELECT shard, coalesce(owner, '') FROM `+shardsT+` WHERE lease_until > now()`)
			if err != nil {
				continue
			}
			cur := map[int16]string{}
			for rows.Next() {
				var s int16
				var o string
				_ = rows.Scan(&s, &o)
				cur[s] = o
			}
			rows.Close()
			for s, o := range cur {
				if p, ok := prev[s]; ok && p != o {
					moves.Add(1)
				}
			}
			for s, o := range cur {
				prev[s] = o
			}
		}
	}()

	// Chaos.
	actions := map[string]int{}
	stopChaos := make(chan struct{})
	var chaos sync.WaitGroup
	chaos.Add(1)
	crng := rand.New(rand.NewPCG(seed, 13))
	go func() {
		defer chaos.Done()
		for {
			select {
			case <-stopChaos:
				return
			case <-time.After(time.Duration(150+crng.IntN(250)) * time.Millisecond):
			}
			mu.Lock()
			var ids []string
			for id := range live {
				ids = append(ids, id)
			}
			slices.Sort(ids)
			mu.Unlock()
			if len(ids) == 0 {
				continue
			}
			id := ids[crng.IntN(len(ids))]
			mu.Lock()
			inc := live[id]
			mu.Unlock()
			switch a := crng.IntN(12); {
			case a < 2: // database pause past the lease
				actions["dbpause"]++
				d := time.Duration(float64(lease) * (0.5 + 1.5*crng.Float64()))
				inc.dbGate.pause()
				bg.Add(1)
				time.AfterFunc(d, func() { defer bg.Done(); inc.dbGate.resume() })
			case a < 4: // broker pause: timeouts, side retries
				actions["pubpause"]++
				d := time.Duration(float64(cfg.PublishTimeout) * (0.5 + 3*crng.Float64()))
				inc.pubGt.pause()
				bg.Add(1)
				time.AfterFunc(d, func() { defer bg.Done(); inc.pubGt.resume() })
			case a < 6: // the whole process pauses
				actions["procpause"]++
				d := time.Duration(float64(lease) * (0.8 + 1.5*crng.Float64()))
				inc.dbGate.pause()
				inc.pubGt.pause()
				bg.Add(1)
				time.AfterFunc(d, func() { defer bg.Done(); inc.dbGate.resume(); inc.pubGt.resume() })
			case a < 7: // slow database for a while
				actions["slowdb"]++
				inc.dbGate.slow.Store(int64(30 * time.Millisecond))
				bg.Add(1)
				time.AfterFunc(time.Duration(crng.IntN(1000))*time.Millisecond, func() { defer bg.Done(); inc.dbGate.slow.Store(0) })
			case a < 8: // graceful stop, restart later
				actions["stop"]++
				mu.Lock()
				delete(live, id)
				mu.Unlock()
				inc.cancel()
				back := time.Duration(crng.IntN(1500)) * time.Millisecond
				bg.Add(1)
				go func() {
					defer bg.Done()
					<-inc.done
					time.Sleep(back)
					start(id)
				}()
			case a < 9: // crash, restart under the same id later
				actions["crash"]++
				mu.Lock()
				delete(live, id)
				mu.Unlock()
				inc.dbGate.dead.Store(true)
				inc.pubGt.dead.Store(true)
				inc.dbGate.resume()
				inc.pubGt.resume()
				inc.cancel()
				back := time.Duration(crng.IntN(2000)) * time.Millisecond
				bg.Add(1)
				time.AfterFunc(back, func() { defer bg.Done(); start(id) })
			case a < 10: // the process freezes; a successor takes its id; the frozen one resumes
				actions["zombie"]++
				mu.Lock()
				delete(live, id)
				mu.Unlock()
				inc.dbGate.pause()
				inc.pubGt.pause()
				successor := lease + time.Duration(crng.IntN(int(lease/time.Millisecond)))*time.Millisecond
				wake := time.Duration(200+crng.IntN(1500)) * time.Millisecond
				bg.Add(1)
				go func() {
					defer bg.Done()
					time.Sleep(successor)
					start(id)
					time.Sleep(wake)
					// Its statements in flight run, stale; its next
					// heartbeat finds the id in use, and it stops.
					inc.dbGate.resume()
					inc.pubGt.resume()
					time.Sleep(lease)
					inc.cancel()
				}()
			case a < 11: // one connection stalls, the others go on
				actions["connstall"]++
				inc.dbGate.stallNext.Store(int64(float64(lease) * (0.5 + 2*crng.Float64())))
			default:
				actions["none"]++
			}
		}
	}()

	// One writer; a fifth of its transactions commit late, their keys
	// not written meanwhile.
	w := newLateWriter(pool, outbox, rng, 30)
	w.maxEvents, w.keylessOneIn, w.topics = 15, 10, m.topics
	for began := time.Now(); time.Since(began) < m.chaos; {
		w.commitDue(ctx, t)
		w.write(ctx, t)
		time.Sleep(time.Duration(5+rng.IntN(15)) * time.Millisecond)
	}
	w.commitAll(ctx, t)
	close(stopChaos)
	chaos.Wait()
	bg.Wait() // every pause over, every restart made
	core.mu.Lock()
	// Kafka heals, refusals included (a topic's limit raised): an event
	// whose dead letter was lost (its relay crashed first) is published
	// now, and must not be behind its key's later events (G3).
	core.failP, core.refuseEvery = 0, 0
	core.mu.Unlock()
	mu.Lock()
	for _, inc := range live {
		inc.dbGate.resume()
		inc.pubGt.resume()
		inc.dbGate.slow.Store(0)
	}
	mu.Unlock()

	healed := time.Now()
	deadline := time.Now().Add(150 * time.Second)
	for {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+outbox).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			if d := time.Since(healed); d > 20*time.Second {
				t.Errorf("the outbox drained only %s after everything healed (G2 stall)", d.Round(time.Second))
			}
			break
		}
		if time.Now().After(deadline) {
			var rows []string
			r, _ := pool.Query(ctx, `SELECT o.id, o.shard, convert_from(o.value, 'UTF8'), o.attempts, coalesce(o.last_error, ''), coalesce(s.owner, '-'), s.lease_until > now()
FROM `+outbox+` o JOIN `+shardsT+` s USING (shard) ORDER BY o.id LIMIT 20`)
			for r.Next() {
				var id int64
				var sh int16
				var v, e, owner string
				var ok *bool
				_ = r.Scan(&id, &sh, &v, new(int), &e, &owner, &ok)
				rows = append(rows, fmt.Sprintf("%d shard %d %s owner %s %v err %q", id, sh, v, owner, ok != nil && *ok, e))
			}
			r.Close()
			t.Fatalf("%d events still pending 150s after everything healed (G2):\n%s", n, strings.Join(rows, "\n"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	close(stopSample)
	sampling.Wait()
	mu.Lock()
	for _, inc := range all {
		inc.cancel()
	}
	incs := slices.Clone(all)
	mu.Unlock()
	for _, inc := range incs {
		select {
		case <-inc.done:
		case <-time.After(40 * time.Second):
			t.Errorf("relay %s did not stop", inc.id)
		}
	}

	// The dead letters: values refused for good only (G7).
	refused := func(v string) bool { return refusable(v, m.refuse) }
	rows, err := pool.Query(ctx, `SELECT convert_from(value, 'UTF8') FROM `+pgx.Identifier{schema, "outbox_dead"}.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	deadValues, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	dead := map[string]bool{} // by "key|seq"
	for _, v := range deadValues {
		parts := strings.SplitN(v, "|", 3)
		ks := parts[0] + "|" + parts[1]
		if !refused(v) || dead[ks] {
			t.Errorf("%s dead-lettered (twice: %v), but Kafka never refused it for good (G7)", ks, dead[ks])
		}
		dead[ks] = true
	}

	core.mu.Lock()
	defer core.mu.Unlock()
	last := map[string]int{}
	for i, v := range core.acked {
		parts := strings.SplitN(v, "|", 3)
		k := parts[0]
		s, _ := strconv.Atoi(parts[1])
		if k == "~" {
			continue
		}
		for dead[k+"|"+strconv.Itoa(last[k]+1)] {
			last[k]++ // dead-lettered: its key's later events follow it
		}
		if s != last[k]+1 {
			t.Errorf("key %s: first publication #%d is seq %d after seq %d (G3)", k, i, s, last[k])
		}
		if s > last[k] {
			last[k] = s
		}
	}
	if len(core.acked)+len(dead) != w.total {
		t.Errorf("%d of %d events published, %d dead-lettered (G2)", len(core.acked), w.total, len(dead))
	}
	t.Logf("%d events (%d dead-lettered), %d calls, %d shard moves sampled, actions %v", w.total, len(dead), core.calls, moves.Load(), actions)
}

type tlogWriter struct {
	t  *testing.T
	id string
}

func (w *tlogWriter) Write(b []byte) (int, error) {
	w.t.Log(w.id + " " + time.Now().Format("15:04:05.000") + " " + strings.TrimSpace(string(b)))
	return len(b), nil
}
