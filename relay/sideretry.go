package relay

import (
	"context"
	"encoding/json"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// The side retry publishes again, beside the rounds, the events that were not
// acknowledged within Config.PublishTimeout.
//
// A partition that cannot take writes (below min.insync.replicas, say)
// answers "try again" for as long as it is sick, and the client retries
// until the round's deadline. Retrying such an event in the rounds would
// make every round wait out the deadline again; instead the rounds leave
// the key out (from its failed event on) and the side retry publishes the failed
// event alone, with the same deadline, in a Publish call of its own that
// runs while the rounds go on. Once the event is acknowledged, its outcome
// is recorded and the key goes back to the rounds, which publish its later
// events. One side retry is in flight at a time; it carries the due events of
// every such key.

// sideResult is a finished side retry.
type sideResult struct {
	start  time.Time
	shards []int16
	losses uint64 // the leases' count when read (leases.held)
	round  roundKey
	events []pendingEvent
	errs   []error
	// ctx is its publish context, live until the outcome is judged (its
	// deadline tells a timeout from a refusal); release ends it.
	ctx     context.Context
	release func()
	acked   time.Time // when Publish returned
}

// sideSQL re-reads the events to retry: still pending, on shards this
// relay owns.
func sideSQL(schema string) string {
	return `SELECT o.id, o.event_id, o.topic, o.key, o.value, o.headers, o.created_at,
       extract(epoch FROM now() - o.first_refused_at)::float8 AS refused_for, o.refused_kind
FROM ` + pgx.Identifier{schema, "outbox"}.Sanitize() + ` o
WHERE o.id = ANY($1::bigint[]) AND o.shard = ANY($2::smallint[])
ORDER BY o.id`
}

// sideDue returns the keys whose side retry is due, and when the next one is.
func (r *Relay) sideDue(now time.Time) (due []string, next time.Time) {
	for bk, k := range r.blocked {
		if !k.timedOut || k.onSide || r.sideGated(bk, k) {
			continue
		}
		if !now.Before(k.sideAt) {
			due = append(due, bk)
		} else if next.IsZero() || k.sideAt.Before(next) {
			next = k.sideAt
		}
	}
	return due, next
}

// startSideRetry publishes the due events of keys that timed out, unless one
// is in flight. Called from the publish loop.
func (r *Relay) startSideRetry(ctx context.Context) {
	if r.sideDone != nil || ctx.Err() != nil {
		return
	}
	due, _ := r.sideDue(time.Now())
	if len(due) == 0 {
		return
	}
	if len(due) > r.cfg.BatchSize {
		due = due[:r.cfg.BatchSize]
	}
	for _, bk := range due {
		if r.finishingFailed[bk] {
			// Its timeout is still being recorded (the round's end
			// waited for the round before's record past its backoff):
			// read its event once it is, with the refusal run that
			// answer ended.
			r.waitFinish()
			break
		}
	}
	shards, losses := r.leases.held()
	ids := make([]int64, len(due))
	for i, bk := range due {
		ids[i] = r.blocked[bk].firstID
	}
	events, err := r.readSide(ctx, ids, shards)
	if err != nil {
		if ctx.Err() == nil {
			r.log.Warn("relay: read events to retry", "error", err)
			r.noteDBError(err)
		}
		return // tried again next time round
	}
	found := map[string]bool{}
	for i := range events {
		found[blockKey(&events[i])] = true
	}
	for _, bk := range due {
		if !found[bk] {
			// Published by another relay after its shard moved, or the
			// shard is not ours any more: the key is not ours to hold.
			delete(r.blocked, bk)
		}
	}
	if len(events) == 0 {
		return
	}
	round := keyOf(events)
	if _, err := r.pool.Exec(ctx, r.st.markSQL, r.cfg.InstanceID, round.lo, round.hi, shards); err != nil {
		if ctx.Err() == nil {
			r.log.Warn("relay: record a retry in flight", "error", err)
			r.noteDBError(err)
		}
		return
	}
	if !r.leases.stillHeld(losses) {
		// As in a round: the shards' owner now publishes these events.
		r.forgetRound(ctx, round)
		r.leases.recheckSoon()
		return
	}
	for i := range events {
		r.blocked[blockKey(&events[i])].onSide = true
	}
	records := make([]Record, len(events))
	for i := range events {
		records[i] = toRecord(&events[i])
	}
	done := make(chan sideResult, 1)
	r.sideDone = done
	res := sideResult{start: time.Now(), shards: shards, losses: losses, round: round, events: events}
	go func() {
		pubCtx, release := r.publishContext(ctx, losses) // a stop's grace, as for a round
		res.errs = r.pub.Publish(pubCtx, records)
		res.ctx, res.release, res.acked = pubCtx, release, time.Now()
		done <- res
	}()
}

// finishSideRetry records a finished side retry's outcome (waiting for it if wait)
// and lets the keys of acknowledged events go back to the rounds.
func (r *Relay) finishSideRetry(ctx context.Context, wait bool) {
	if r.sideDone == nil {
		return
	}
	var res sideResult
	if wait {
		res = <-r.sideDone
	} else {
		select {
		case res = <-r.sideDone:
		default:
			return
		}
	}
	r.sideDone = nil
	defer res.release()
	for i := range res.events {
		if k := r.blocked[blockKey(&res.events[i])]; k != nil {
			k.onSide = false
		}
	}
	if len(res.errs) != len(res.events) {
		r.log.Warn("relay: publisher returned a wrong number of results", "got", len(res.errs), "want", len(res.events))
		r.forgetRound(ctx, res.round)
		return
	}
	records := make([]Record, len(res.events))
	for i := range res.events {
		records[i] = toRecord(&res.events[i])
	}
	o := r.judge(ctx, res.ctx, res.losses, res.events, records, res.errs)
	if r.events != nil {
		r.observeAcked(res.events, o.acked, res.start, res.acked)
	}
	// The outcome is recorded before the keys go back to the rounds, so
	// that no round reads an acknowledged event again.
	r.record(ctx, res.start, o, res.shards, res.losses, res.round)
	for i := range res.events {
		if bk := blockKey(&res.events[i]); !o.failedKeys[bk] {
			delete(r.blocked, bk)
		}
	}
}

func (r *Relay) readSide(ctx context.Context, ids []int64, shards []int16) ([]pendingEvent, error) {
	slices.Sort(ids)
	rows, err := r.pool.Query(ctx, r.sideSQL, ids, shards)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []pendingEvent
	for rows.Next() {
		var e pendingEvent
		var headers []byte
		var eventID [16]byte
		if err := rows.Scan(&e.id, &eventID, &e.topic, &e.key, &e.value, &headers, &e.createdAt, &e.refusedFor, &e.refusedKind); err != nil {
			return nil, err
		}
		e.eventID = formatUUID(eventID)
		if len(headers) > 0 {
			if err := json.Unmarshal(headers, &e.headers); err != nil {
				e.headers = map[string]string{"onceflow-bad-headers": string(headers)}
			}
		}
		out = append(out, e)
	}
	return out, rows.Err()
}
