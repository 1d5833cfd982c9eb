package consumer

import (
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Taking turns on a pool's connections. A worker whose COMMIT carries its
// next message's BEGIN (see commit) keeps its connection from message to
// message; with a pool smaller than the workers (partitions × Concurrency:
// pgx's default pool is max(4, CPUs)), a partition with a backlog would
// keep it until its queue ran dry while other partitions waited in
// pool.Acquire. So a run of pipelined messages on one connection is a
// turn, bounded by turnMessages and turnTime: at its end, if the pool has
// no connection to spare (someone may be waiting), the worker commits
// alone and hands its connection back, and its next message queues for a
// connection behind whoever waited (pgxpool hands connections out in
// arrival order). With connections to spare nobody can be waiting, and the
// turn simply starts over: pipelining costs nothing then.
const (
	// turnMessages bounds the messages a worker runs on one connection
	// while the pool is exhausted. A turn's end costs one round trip (its
	// last COMMIT goes alone) and the hand-over, spread over the turn's
	// messages. A worker waiting for a connection waits about one turn
	// per worker queued ahead of it.
	turnMessages = 16
	// turnTime bounds a turn's time, for slow messages, where a round
	// trip more per turn costs little. It is no shorter because messages
	// slowed by load would make the turns short: at 20 ms, 8 partitions
	// on a pool of 4 on a loaded 2-core machine (about 3 ms a message, so
	// turns of 7) lost some 13 % of their throughput; at 100 ms, nothing
	// measurable.
	turnTime = 100 * time.Millisecond
)

// turn is a worker's current run of messages on one connection.
type turn struct {
	n     int       // messages pipelined so far
	start time.Time // when the turn's first message began
}

// begun starts a turn: the worker's message begins on a connection of its
// own.
func (t *turn) begun() { *t = turn{start: time.Now()} }

// statter is *pgxpool.Pool.
type statter interface {
	Stat() *pgxpool.Stat
}

// keepConnection reports whether the worker of la may begin its next
// message on its connection, or must hand it back to the pool.
func (p *Processor) keepConnection(la *lookahead) bool {
	t := &la.turn
	t.n++
	if t.n < turnMessages && time.Since(t.start) < turnTime {
		return true
	}
	if !p.poolExhausted() {
		t.begun()
		return true
	}
	return false
}

// poolExhausted reports whether every connection of the pool is taken (or
// being opened), so that an Acquire would wait. A pool that cannot say is
// taken for exhausted.
func (p *Processor) poolExhausted() bool {
	s, ok := p.db.(statter)
	if !ok {
		return true
	}
	st := s.Stat()
	return st.AcquiredConns()+st.ConstructingConns() >= st.MaxConns()
}
