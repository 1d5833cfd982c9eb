package consumer

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Transport is what an adapter gives the Processor for one partition.
type Transport interface {
	// MarkDone says that msg and every message before it in its partition
	// are finished (committed, duplicate or dead-lettered): the adapter may
	// commit offset msg.Offset+1. Calls for one partition come in offset
	// order and never concurrently. It must not block for long.
	MarkDone(msg Message)
	// PublishDeadLetter publishes rec to rec.Topic and returns once the
	// broker acknowledged it (acks=all). The Processor retries on error.
	PublishDeadLetter(ctx context.Context, rec DeadLetter) error
}

// QueueWaker is an optional interface of a Transport whose adapter feeds
// the partition with TryAdd and pauses its fetching when the queue is
// full: QueueRoom is called when a handler took messages from the queue
// and its bytes fell below half of Config.QueueBytes, or to none, so that
// the adapter can feed it before its handlers run dry rather than at its
// next poll. It is called from the partition's goroutines and must not
// block.
type QueueWaker interface {
	QueueRoom()
}

// ErrStopped is returned by Partition.Add once the partition is stopped.
var ErrStopped = errors.New("consumer: partition stopped")

// Partition processes the messages of one Kafka partition, in the
// Processor's mode: in order, key-parallel, or in batches. Adapters create
// one per assigned partition with StartPartition, Add the partition's
// records in offset order, and Stop it when the partition is revoked or the
// consumer shuts down. Add and Stop are safe for concurrent use.
type Partition struct {
	p      *Processor
	t      *guard
	in     chan Message
	stop   chan struct{}
	once   sync.Once
	cancel context.CancelFunc
	done   chan struct{}
	// of is the topic and partition of the first message queued, for
	// Stop's log; nil until then.
	of atomic.Pointer[topicPartition]
	// queued is the bytes of the messages queued and not yet taken by a
	// handler (Config.QueueBytes bounds it); room is signaled when it
	// drops.
	queued atomic.Int64
	// parked is the part of queued that waits behind a busy key
	// (key-parallel mode): it leaves only when that key's handler
	// finishes, however long that takes.
	parked atomic.Int64
	room   chan struct{}
	// waker is the Transport as a QueueWaker, or nil.
	waker QueueWaker
}

type topicPartition struct {
	topic     string
	partition int32
}

// note remembers m's topic and partition, once.
func (w *Partition) note(m *Message) {
	if w.of.Load() == nil {
		w.of.CompareAndSwap(nil, &topicPartition{topic: m.Topic, partition: m.Partition})
	}
}

// StartPartition starts processing a partition. Canceling ctx abandons the
// partition's work at once: open transactions roll back and nothing more is
// marked done.
func (p *Processor) StartPartition(ctx context.Context, t Transport) *Partition {
	ctx, cancel := context.WithCancel(ctx)
	w := &Partition{
		p:      p,
		t:      &guard{t: t},
		in:     make(chan Message, p.cfg.QueueSize),
		room:   make(chan struct{}, 1),
		stop:   make(chan struct{}),
		cancel: cancel,
		done:   make(chan struct{}),
	}
	w.waker, _ = t.(QueueWaker)
	p.runningMu.Lock()
	p.running[w.stop] = map[*pgconn.PgConn]struct{}{}
	p.runningMu.Unlock()
	var wg sync.WaitGroup
	switch {
	case p.batch != nil:
		wg.Add(1)
		go func() { defer wg.Done(); w.runBatches(ctx) }()
	case p.cfg.Concurrency == 1:
		wg.Add(1)
		go func() { defer wg.Done(); w.runInOrder(ctx) }()
	default:
		w.startLanes(ctx, &wg)
	}
	go func() {
		wg.Wait()
		cancel()
		p.runningMu.Lock()
		delete(p.running, w.stop)
		p.runningMu.Unlock()
		close(w.done)
	}()
	return w
}

// Add queues messages, blocking while the partition's queue is full
// (Config.QueueSize messages, or Config.QueueBytes). It returns ErrStopped
// once the partition stopped, or ctx's error.
func (w *Partition) Add(ctx context.Context, msgs ...Message) error {
	for _, m := range msgs {
		select {
		case <-w.stop:
			return ErrStopped
		default:
		}
		w.note(&m)
		n := size(&m)
		for !w.reserve(n) {
			select {
			case <-w.room:
			case <-w.stop:
				return ErrStopped
			case <-w.done:
				return ErrStopped
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		select {
		case w.in <- m:
			continue
		case <-w.stop:
		case <-w.done:
		case <-ctx.Done():
			w.unreserve(n) // the partition runs on: give the room back
			return ctx.Err()
		}
		return ErrStopped
	}
	return nil
}

// AddSkip queues a record that is not a message, such as a transaction
// control record that a client library hands up: it is never processed,
// but its offset is marked done in order with the messages around it. It
// blocks and fails like Add.
func (w *Partition) AddSkip(ctx context.Context, msg Message) error {
	msg.skip = true
	return w.Add(ctx, msg)
}

// TryAdd queues as many of msgs as fit without blocking and returns how
// many it took; adapters pause fetching the partition while it is full
// rather than block their poll loop. It takes none once stopped.
func (w *Partition) TryAdd(msgs []Message) int {
	for i, m := range msgs {
		select {
		case <-w.stop:
			return i
		case <-w.done:
			return i
		default:
		}
		w.note(&m)
		n := size(&m)
		if !w.reserve(n) {
			return i
		}
		select {
		case w.in <- m:
		default:
			w.unreserve(n) // full by count: nothing left the queue, so no wake-up
			return i
		}
	}
	return len(msgs)
}

// size is what m counts against Config.QueueBytes: its key, value and
// headers.
func size(m *Message) int64 {
	n := len(m.Key) + len(m.Value)
	for _, h := range m.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return int64(n)
}

// reserve counts n more bytes as queued if they fit under
// Config.QueueBytes, or if nothing is queued but messages parked behind
// busy keys holding less than the bound (a message larger than what is
// left goes alone: a slow key's parked message must not hold up the other
// keys), and reports whether it did.
func (w *Partition) reserve(n int64) bool {
	limit := w.p.cfg.QueueBytes
	for {
		q := w.queued.Load()
		if q > 0 && q+n > limit {
			if p := w.parked.Load(); q != p || p >= limit {
				return false
			}
		}
		if w.queued.CompareAndSwap(q, q+n) {
			return true
		}
	}
}

// park counts n queued bytes as parked behind a busy key. When then
// nothing but parked messages is queued, a message larger than the room
// left may be taken (reserve): wake an Add waiting for room, and the
// adapter.
func (w *Partition) park(n int64) {
	p := w.parked.Add(n)
	if w.queued.Load() != p || p >= w.p.cfg.QueueBytes {
		return
	}
	select {
	case w.room <- struct{}{}:
	default:
	}
	if w.waker != nil {
		w.waker.QueueRoom()
	}
}

// unreserve gives back n bytes reserved for a message that was not
// queued after all. It wakes nobody: no message left the queue, and a
// wake-up would send the adapter straight back to a queue still full
// (kgoconsumer's poll loop spun on it).
func (w *Partition) unreserve(n int64) { w.queued.Add(-n) }

// taken uncounts n queued bytes, a message a handler took, and wakes an
// Add waiting for room, and the adapter (QueueWaker) when the queue fell
// below half its bytes or emptied.
func (w *Partition) taken(n int64) {
	if n == 0 {
		return
	}
	q := w.queued.Add(-n)
	select {
	case w.room <- struct{}{}:
	default:
	}
	if half := w.p.cfg.QueueBytes / 2; w.waker != nil && q < half && (q+n >= half || q == 0) {
		w.waker.QueueRoom()
	}
}

// abandonAfter is how long Stop waits for work whose context it canceled
// before abandoning it.
const abandonAfter = 500 * time.Millisecond

// Stop stops the partition: queued messages that have not started are
// dropped (their offsets stay uncommitted, so they are delivered again),
// retries waiting for their backoff are abandoned, and work in a transaction
// is given until ctx ends to finish before its context is canceled, which
// rolls its transaction back. Stop returns once nothing of the partition
// runs any more, or, if a handler ignores its canceled context, half a
// second after the cancel: that handler is abandoned (an Error naming the
// topic and partition is logged) and runs on, but its transaction can no
// longer commit (its COMMIT carries the canceled context: pgx never sends
// it) and nothing of the partition is marked done any more. Stop closes that
// handler's connection (the pool gets it back once the handler returns): the
// server rolls its transaction back at once, with its message's dedup
// record, so the message delivered again (to the partition's next owner)
// need not wait for the handler; the handler's later statements fail. After
// Stop returns, MarkDone is not called again. Stop is idempotent.
func (w *Partition) Stop(ctx context.Context) {
	w.once.Do(func() { close(w.stop) })
	defer w.t.close()
	select {
	case <-w.done:
		return
	case <-ctx.Done():
	}
	w.cancel()
	t := time.NewTimer(abandonAfter)
	defer t.Stop()
	select {
	case <-w.done:
	case <-t.C:
		var attrs []slog.Attr
		if tp := w.of.Load(); tp != nil {
			attrs = []slog.Attr{slog.String("topic", tp.topic), slog.Int("partition", int(tp.partition))}
		}
		w.p.closeRunning(w.stop)
		w.p.log.LogAttrs(context.Background(), slog.LevelError,
			"consumer: a handler ignored its canceled context; abandoning it: its transaction cannot commit and its message will be delivered again",
			attrs...)
	}
}

// guard passes MarkDone on until the partition is stopped, so that work
// abandoned by Stop marks nothing done.
type guard struct {
	t      Transport
	mu     sync.Mutex
	closed bool
}

func (g *guard) MarkDone(msg Message) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.closed {
		g.t.MarkDone(msg)
	}
}

func (g *guard) PublishDeadLetter(ctx context.Context, rec DeadLetter) error {
	return g.t.PublishDeadLetter(ctx, rec)
}

func (g *guard) close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}

// next returns the next queued message, or false once stopped.
func (w *Partition) next(ctx context.Context) (Message, bool) {
	select {
	case <-w.stop:
		return Message{}, false
	case <-ctx.Done():
		return Message{}, false
	case m := <-w.in:
		select {
		case <-w.stop:
			return Message{}, false
		default:
			return m, true
		}
	}
}

// tryNext returns the next queued message if one is waiting, without
// blocking, or false (also once stopped).
func (w *Partition) tryNext() (Message, bool) {
	if w.stopped() {
		return Message{}, false
	}
	select {
	case m := <-w.in:
		return m, true
	default:
		return Message{}, false
	}
}

func (w *Partition) stopped() bool {
	select {
	case <-w.stop:
		return true
	default:
		return false
	}
}

func (w *Partition) runInOrder(ctx context.Context) {
	// pending is the message taken from the queue to run next, so that
	// its BEGIN could go with the previous COMMIT.
	var pending *Message
	la := &lookahead{next: func() (Message, bool) {
		if pending == nil {
			if m, ok := w.tryNext(); ok {
				pending = &m
			}
		}
		if pending == nil {
			return Message{}, false
		}
		return *pending, true
	}}
	defer la.discard()
	for {
		var m Message
		if pending != nil {
			if w.stopped() || ctx.Err() != nil {
				return
			}
			m, pending = *pending, nil
		} else {
			var ok bool
			if m, ok = w.next(ctx); !ok {
				return
			}
		}
		w.taken(size(&m))
		if err := w.p.runOne(ctx, w.stop, m, w.t, false, la); err != nil {
			return
		}
		w.t.MarkDone(m)
	}
}

func (w *Partition) runBatches(ctx context.Context) {
	batch := make([]Message, 0, w.p.cfg.BatchSize)
	for {
		m, ok := w.next(ctx)
		if !ok {
			return
		}
		batch = append(batch[:0], m)
		n := size(&m)
	fill:
		for len(batch) < w.p.cfg.BatchSize {
			select {
			case m := <-w.in:
				batch = append(batch, m)
				n += size(&m)
			default:
				break fill
			}
		}
		w.taken(n)
		if err := w.p.runBatch(ctx, w.stop, batch, w.t); err != nil {
			return
		}
		w.t.MarkDone(batch[len(batch)-1])
		clear(batch) // drop the messages' bytes before waiting for more
	}
}

// Key-parallel mode: a dispatcher hands messages to Concurrency workers.
// A key with a message in flight collects its later messages in a queue
// that the worker holding the key drains in order, so a key's messages run
// one at a time and in offset order while other keys go ahead. The tracker
// marks done only up to the lowest unfinished message.

type slot struct {
	msg  Message
	done bool
}

type tracker struct {
	mu    sync.Mutex
	slots []*slot
}

func (tr *tracker) add(m Message) *slot {
	s := &slot{msg: m}
	tr.mu.Lock()
	tr.slots = append(tr.slots, s)
	tr.mu.Unlock()
	return s
}

// finish marks s done and calls mark with the last message of the finished
// prefix, if it grew, under the lock so marks stay in offset order.
func (tr *tracker) finish(s *slot, mark func(Message)) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	s.done = true
	n := 0
	for n < len(tr.slots) && tr.slots[n].done {
		n++
	}
	if n == 0 {
		return
	}
	last := tr.slots[n-1].msg
	clear(tr.slots[:n])
	tr.slots = tr.slots[n:]
	mark(last)
}

// keys tracks keys with a message in flight and their waiting messages.
type keys struct {
	mu   sync.Mutex
	busy map[string][]*slot
}

// claim reports whether s may run now; if its key is busy, s is queued
// behind it.
func (k *keys) claim(s *slot) bool {
	if s.msg.Key == nil {
		return true
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	key := string(s.msg.Key)
	if q, ok := k.busy[key]; ok {
		k.busy[key] = append(q, s)
		return false
	}
	k.busy[key] = nil
	return true
}

// release returns the next waiting message of s's key, or nil and frees
// the key.
func (k *keys) release(s *slot) *slot {
	if s.msg.Key == nil {
		return nil
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	key := string(s.msg.Key)
	q := k.busy[key]
	if len(q) == 0 {
		delete(k.busy, key)
		return nil
	}
	k.busy[key] = q[1:]
	return q[0]
}

func (w *Partition) startLanes(ctx context.Context, wg *sync.WaitGroup) {
	tr := &tracker{}
	ks := &keys{busy: map[string][]*slot{}}
	ready := make(chan *slot)
	// credits bounds the messages between dispatch and finish.
	credits := make(chan struct{}, w.p.cfg.QueueSize)
	stopped := func() bool {
		select {
		case <-w.stop:
			return true
		case <-ctx.Done():
			return true
		default:
			return false
		}
	}
	for range w.p.cfg.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// held is the slot this lane runs next, if it has one at
			// hand: the next waiting message of the key it just
			// finished, or one taken from ready early so that its
			// BEGIN could go with the previous COMMIT.
			var held []*slot
			taken := false // held[0] came from ready through la.next
			la := &lookahead{next: func() (Message, bool) {
				if len(held) == 0 {
					select {
					case s := <-ready:
						held, taken = append(held, s), true
					default:
						return Message{}, false
					}
				}
				return held[0].msg, true
			}}
			// handOff passes a slot whose key is claimed to whichever
			// lane is free first.
			handOff := func(s *slot) {
				wg.Add(1)
				go func() {
					defer wg.Done()
					select {
					case ready <- s:
					case <-w.stop:
					case <-ctx.Done():
					}
				}()
			}
			la.putBack = func() {
				if taken {
					handOff(held[0])
					held, taken = held[1:], false
				}
			}
			defer la.discard()
			for {
				var s *slot
				if len(held) > 0 {
					s, held, taken = held[0], held[1:], false
				} else {
					select {
					case <-w.stop:
						return
					case <-ctx.Done():
						return
					case s = <-ready:
					}
				}
				if stopped() {
					return
				}
				// Until now s waited ahead of its handler, in the
				// queue, behind its key or for a lane.
				w.taken(size(&s.msg))
				if err := w.p.runOne(ctx, w.stop, s.msg, w.t, false, la); err != nil {
					return
				}
				tr.finish(s, w.t.MarkDone)
				<-credits
				if next := ks.release(s); next != nil {
					w.parked.Add(-size(&next.msg))
					if taken {
						// This lane will run the message it took
						// for pipelining first; the key's next
						// message must not wait behind it (and
						// its retries).
						handOff(next)
					} else {
						held = append(held, next)
					}
				}
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			m, ok := w.next(ctx)
			if !ok {
				return
			}
			select {
			case credits <- struct{}{}:
			case <-w.stop:
				return
			case <-ctx.Done():
				return
			}
			s := tr.add(m)
			if !ks.claim(s) {
				w.park(size(&m))
				continue
			}
			select {
			case ready <- s:
			case <-w.stop:
				return
			case <-ctx.Done():
				return
			}
		}
	}()
}
