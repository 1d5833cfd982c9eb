package relay

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// InstanceInUseError is returned by Run when another live relay holds the
// same Config.InstanceID: two relays under one id would both own every
// shard and publish every event twice.
type InstanceInUseError struct {
	InstanceID string
	Hostname   string // of the relay holding it
	PID        int
	Heartbeat  time.Time
}

func (e *InstanceInUseError) Error() string {
	return fmt.Sprintf("relay: instance id %q is in use by a live relay (host %q, pid %d, last heartbeat %s): give each relay its own instance id (--instance-id, ONCEFLOW_INSTANCE_ID, Config.InstanceID), or leave it empty for a unique default",
		e.InstanceID, e.Hostname, e.PID, e.Heartbeat.Format(time.RFC3339))
}

// leases keeps this relay's share of the shards: it heartbeats the instance
// row, renews its shard leases, takes free or expired shards up to its fair
// share, and asks the publish loop to hand back shards above it.
//
// What holds:
//
//   - A hand-back never overlaps this relay's work on the shards: the
//     publish loop calls releaseExcess only with nothing of its own in
//     flight (no round read ahead, the last round's outcome recorded, no
//     side retry with Kafka), and a tick never puts back in the owned set
//     a shard handed back while or since it renewed (releasedBy), so the
//     relay reads no shard it handed back.
//   - The owned set (snapshot, OwnedShards) holds only shards the last tick
//     renewed or took in the database, less those handed back since, and
//     is empty once those leases may have lapsed (validUntil, on the local
//     clock, a sixth of the lease early).
//   - A renewal extends only this process's own takes (the shards of the
//     owned set, at the epochs it took them under): a shard comes to this
//     process only by a take, which gives it a new epoch, never by a
//     renewal of a lease another process under the same id made.
//   - Events read under a snapshot are published only while every shard of
//     it has stayed held (stillHeld: no loss since, the leases valid), and
//     their publish is cut short once that ends (boundByLeases). A loss is
//     a shard a tick did not renew, a hand-back, or leases whose validity
//     passed before a tick installed a renewal: a renewal after that does
//     not prove the shards were held throughout.
//
// What does not: a relay that stops renewing in time (a database outage, a
// stalled process, its instance id taken over) can lose a shard to another
// relay while a round of its events is with Kafka. Then the round's delete
// re-checks ownership and leaves those events to the new owner, which
// publishes them again, in order: duplicates, never a loss or a first
// publication out of order (G2, G3). The round's publish is cut short a
// sixth of the lease before the leases lapse, so what still lands after
// the new owner took over is what the client had sent by then: were the
// new owner to dead-letter such an event (refused for good) and publish
// its key's next, one that landed late anyway would follow it.
type leases struct {
	st       *store
	id       string
	token    string // this process's, in the instance row
	host     string
	duration time.Duration
	obs      Observer
	log      *slog.Logger

	mu    sync.Mutex
	owned []int16 // sorted
	// until is, per owned shard, the lease_until its last renewal (or
	// take) by this process wrote: the proof at a stop that a shard's
	// lease is still this process's when its instance row is gone.
	until [NumShards]time.Time
	// epoch is, per owned shard, the epoch its take by this process
	// wrote (relay_shards.epoch): the take the shard is held under. It
	// changes only with a loss (see losses), so the events read under a
	// snapshot were read under these epochs while losses is unchanged.
	epoch      [NumShards]int64
	validUntil time.Time // local clock: when the leases may have lapsed
	// losses counts the times a shard may have left this relay's hands: a
	// renewal that did not renew it (its lease lapsed, whether or not it
	// was taken back since), a renewal installed after validUntil, or a
	// hand-back. Events read while it had one value may be published only
	// while it still has it (stillHeld).
	losses    uint64
	lostC     chan struct{} // closed (and replaced) at each loss
	excess    int           // shards to hand back at the next chance
	releasing []int16       // shards being handed back now
	// releases counts the hand-backs sent (releaseExcess), and releasedBy
	// is, per shard, the count of the last one that gave it back: a tick
	// keeps out of its result every shard handed back since it began
	// renewing (its renewal may have reached the database first).
	releases   uint64
	releasedBy [NumShards]uint64
	lapsed     bool // the leases lapsed before a renewal: reported as 0 owned
	claimed    bool // the instance row is this process's (charged its crashed round)
	changed    chan struct{}
	// recheck asks the lease loop for a tick now (recheckSoon): a delete
	// refused for a shard this relay no longer holds means its leases may
	// have lapsed, and until a tick says which shards it lost the publish
	// loop would read and publish their events again, round after round.
	recheck chan struct{}

	outboxLocked bool // tick's: the last charge found the outbox locked (logged once)
	// restoreRefused is tick's: writing back missing rows of relay_shards
	// failed (logged once until it succeeds).
	restoreRefused bool
	// reachesKafka says whether this relay has reached Kafka within its
	// handoff period (nil: always). standingAside is tick's: it handed its
	// shards over for want of Kafka (logged once each way).
	reachesKafka  func() bool
	standingAside bool

	// testHook, nil outside tests (export_test.go sets it before Run), is
	// called at the named points of the lease upkeep, so that a test can
	// hold one goroutine there and force an interleaving.
	testHook func(point string)
}

// at calls the test hook, if any.
func (l *leases) at(point string) {
	if l.testHook != nil {
		l.testHook(point)
	}
}

func newLeases(st *store, id string, duration time.Duration, obs Observer, log *slog.Logger) *leases {
	host, _ := os.Hostname()
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return &leases{st: st, id: id, token: hex.EncodeToString(b), host: host, duration: duration, obs: obs, log: log,
		changed: make(chan struct{}, 1), recheck: make(chan struct{}, 1), lostC: make(chan struct{})}
}

// recheckSoon asks for a tick before the next interval's; it never waits.
func (l *leases) recheckSoon() {
	select {
	case l.recheck <- struct{}{}:
	default:
	}
}

// snapshot returns the shards this relay may publish now.
func (l *leases) snapshot() []int16 {
	shards, _ := l.held()
	return shards
}

// held is snapshot, with the count of losses it was taken under, for
// stillHeld.
func (l *leases) held() ([]int16, uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if time.Now().After(l.validUntil) {
		return nil, l.losses
	}
	return slices.Clone(l.owned), l.losses
}

// stillHeld reports whether the shards of a snapshot taken under losses are
// all still held, without a break, and their leases valid: checked just
// before events read from them are published. A relay whose statements
// stalled past its lease between a read and its publish (a database
// failing over, a stalled process) may meanwhile have lost the shards to a
// relay that settled those events: dead-lettered a key's first event and
// published the next, say, which the stale publish would then follow (G3).
// A publish that starts while this holds ends its lease at least a sixth of
// it later, by the database clock.
func (l *leases) stillHeld(losses uint64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.losses == losses && time.Now().Before(l.validUntil)
}

// epochsOf returns, by shard, the epochs the shards of a snapshot taken
// under losses were held under then (-1 for the other shards), or nil if
// a shard may have left this relay's hands since. A statement that acts
// for the shards' owner checks them in the database, where a take since
// (another relay's, or this relay's own after its lease lapsed) has
// changed them: the statement may run long after this check (a stalled
// connection).
func (l *leases) epochsOf(losses uint64, shards []int16) []int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.losses != losses {
		return nil
	}
	epochs := make([]int64, NumShards)
	for s := range epochs {
		epochs[s] = -1
	}
	for _, s := range shards {
		epochs[s] = l.epoch[s]
	}
	return epochs
}

// untilLost calls lost once the shards of a snapshot taken under losses
// are no longer held (stillHeld), unless done is closed first.
func (l *leases) untilLost(losses uint64, done <-chan struct{}, lost func()) {
	for {
		l.mu.Lock()
		held := l.losses == losses && time.Now().Before(l.validUntil)
		lostC, until := l.lostC, l.validUntil
		l.mu.Unlock()
		if !held {
			lost()
			return
		}
		t := time.NewTimer(time.Until(until)) // a renewal since moves it on
		select {
		case <-lostC:
		case <-t.C:
		case <-done:
			t.Stop()
			return
		}
		t.Stop()
	}
}

// lose notes that a shard left this relay's hands. l.mu is held.
func (l *leases) lose() {
	l.losses++
	close(l.lostC)
	l.lostC = make(chan struct{})
}

func (l *leases) interval() time.Duration { return l.duration / 3 }

// chargeCrashed charges the events of dead relays' rounds an attempt. It
// reports false, without an error, when the outbox table stayed locked by
// another session for longer than a tenth of the lease (its rows locked
// are skipped, see chargeCrashedSQL).
func (l *leases) chargeCrashed(ctx context.Context) (bool, error) {
	wait := max(l.duration/10, 10*time.Millisecond)
	err := l.chargeStatement(ctx, wait, l.st.chargeCrashedSQL)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
		if !l.outboxLocked {
			l.log.Warn("relay: the outbox is locked by another session; shards are renewed, none taken, until it is free", "error", err)
		}
		l.outboxLocked = true
		return false, nil
	}
	if err == nil && l.outboxLocked {
		l.outboxLocked = false
		l.log.Info("relay: the outbox is free again")
	}
	return err == nil, err
}

// chargeStatement runs one of the crash charges in a transaction of its
// own, with JIT compilation off, without a statement_timeout and, unless
// lockWait is 0, with a lock_timeout. Every tick runs the charge of dead
// relays' rounds, and on a large outbox PostgreSQL costs it past
// jit_above_cost, however few rows it touches: it was compiled on every
// tick (15-60 ms of a backend's CPU at 300,000 pending events, 120-250 ms
// at 1M, each tick of each relay). A session's statement_timeout (a
// role's, on managed PostgreSQL) shorter than the charge of a crashed
// round stopped every relay for good: the charge comes before any shard
// is taken, and each tick retried the same work; its work is bounded by
// the rounds it charges (BatchSize ids each). Set for the transaction
// only, so it holds behind PgBouncer in transaction mode.
func (l *leases) chargeStatement(ctx context.Context, lockWait time.Duration, sql string, args ...any) error {
	return pgx.BeginFunc(ctx, l.st.pool, func(tx pgx.Tx) error {
		settings, settingArgs := `SELECT set_config('jit', 'off', true), set_config('statement_timeout', '0', true)`, []any(nil)
		if lockWait > 0 {
			settings += `, set_config('lock_timeout', $1, true)`
			settingArgs = append(settingArgs, strconv.FormatInt(lockWait.Milliseconds(), 10))
		}
		if _, err := tx.Exec(ctx, settings, settingArgs...); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, sql, args...)
		return err
	})
}

// tick does one round of lease upkeep.
func (l *leases) tick(ctx context.Context) error {
	start := time.Now()
	dur := l.duration.String()
	reaches := l.reachesKafka == nil || l.reachesKafka()
	var held bool
	if err := l.st.pool.QueryRow(ctx, l.st.heartbeatSQL, l.id, l.host, os.Getpid(), dur, l.token, reaches).Scan(&held); err != nil {
		if !errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("heartbeat: %w", err)
		}
		inUse := &InstanceInUseError{InstanceID: l.id}
		_ = l.st.pool.QueryRow(ctx, l.st.holderSQL, l.id).Scan(&inUse.Hostname, &inUse.PID, &inUse.Heartbeat)
		return inUse
	}
	if !l.claimed {
		// A relay restarted under the same id may find its own crashed
		// round: charge it before taking any shard.
		if err := l.chargeStatement(ctx, 0, l.st.chargeOwnSQL, l.id); err != nil {
			return fmt.Errorf("charge a crashed round: %w", err)
		}
		l.claimed = true
	}
	// Charge an attempt to the events a dead relay had in flight, before
	// any of its shards is taken. The charge writes the outbox: an
	// operator's long lock on it (VACUUM FULL, CLUSTER, a migration) must
	// not hold up this tick's heartbeat and renewal, or every relay's
	// leases would lapse together and, once it ends, relays would take
	// each other's shards for dead (publishing their events again, and
	// charging them a crash). Then this tick renews and takes nothing new.
	charged, err := l.chargeCrashed(ctx)
	if err != nil {
		return fmt.Errorf("charge crashed rounds: %w", err)
	}
	var live, reaching, shardRows int
	if err := l.st.pool.QueryRow(ctx, l.st.liveInstancesSQL).Scan(&live, &reaching, &shardRows); err != nil {
		return fmt.Errorf("count live relays: %w", err)
	}
	if shardRows < NumShards {
		// Not this tick's failure if it cannot (a role without INSERT on
		// relay_shards): the owned shards are renewed all the same.
		if tag, err := l.st.pool.Exec(ctx, l.st.restoreShardsSQL); err != nil {
			if !l.restoreRefused { // once, not every tick
				l.log.Warn("relay: rows of relay_shards are missing (deleted by hand?), and writing them back failed; their shards' events wait", "missing", NumShards-shardRows, "error", err)
			}
			l.restoreRefused = true
		} else {
			l.restoreRefused = false
			l.log.Warn("relay: rows of relay_shards were missing (deleted by hand?); written back, unowned, for the relays to take",
				"restored", tag.RowsAffected())
		}
	}
	fair := l.fairShare(live, reaching, reaches)

	l.mu.Lock()
	releases := l.releases
	mine := slices.Clone(l.owned)
	mineEpochs := make([]int64, len(mine))
	for i, s := range mine {
		mineEpochs[i] = l.epoch[s]
	}
	l.mu.Unlock()
	var until [NumShards]time.Time
	var epochs [NumShards]int64
	renewed, err := l.queryShards(ctx, &until, &epochs, l.st.renewSQL, l.id, dur, mine, mineEpochs)
	if err != nil {
		return fmt.Errorf("renew shards: %w", err)
	}
	var kept [NumShards]bool // renewed without a break
	for _, s := range renewed {
		kept[s] = true
	}
	var taken []int16
	if len(renewed) < fair && charged {
		// takeSQL also re-takes this relay's own lapsed leases first.
		taken, err = l.queryShards(ctx, &until, &epochs, l.st.takeSQL, l.id, dur, fair-len(renewed))
		if err != nil {
			return fmt.Errorf("take shards: %w", err)
		}
		renewed = append(renewed, taken...)
	}
	slices.Sort(renewed)
	renewed = slices.Compact(renewed)
	l.at("renewed")

	l.mu.Lock()
	// Shards being handed back right now, or handed back since the renewal
	// began, stay out even if renewed above: the renewal may have run
	// before the hand-back committed, and another relay may own them now.
	// (One that this tick took again after the hand-back stays out too:
	// a renewal extends only the owned set's takes, so its lease lapses
	// and a later take, this relay's or another's, gets it back.)
	renewed = slices.DeleteFunc(renewed, func(s int16) bool {
		return slices.Contains(l.releasing, s) || l.releasedBy[s] > releases
	})
	before := len(l.owned)
	if time.Now().After(l.validUntil) {
		// The leases may have lapsed since the last renewal installed:
		// a renewal now does not prove them held throughout. Another
		// process may have held them meanwhile and handed them back, or
		// taken this relay's instance id and returned it; or a take of
		// this relay's committed with its answer lost, so no tick
		// installed it.
		l.lose()
	} else {
		for _, s := range l.owned {
			if !kept[s] {
				l.lose()
				break
			}
		}
	}
	l.owned = renewed
	for _, s := range renewed {
		l.until[s], l.epoch[s] = until[s], epochs[s]
	}
	l.validUntil = start.Add(l.duration - l.duration/6)
	l.excess = max(len(renewed)-fair, 0)
	signal := before != len(renewed) || l.excess > 0 || l.lapsed
	l.lapsed = false
	excess := l.excess
	l.mu.Unlock()
	l.at("installed")
	if len(taken) > 0 {
		l.log.Info("relay: took shards", "shards", len(taken), "owned", len(renewed))
	}
	if l.log.Enabled(ctx, slog.LevelDebug) {
		l.log.Debug("relay: leases", "live", live, "fair", fair, "owned", len(renewed), "taken", len(taken), "excess", excess)
	}
	if signal {
		l.obs.ObserveShards(len(renewed))
		select {
		case l.changed <- struct{}{}:
		default:
		}
	}
	return nil
}

// fairShare is how many shards this relay should hold: an equal share of
// the live relays that reach Kafka, none while it does not and another
// does (it hands its shards over), and an equal share of all live relays
// while none does (the brokers are down: there is nobody to hand them to).
func (l *leases) fairShare(live, reaching int, reaches bool) int {
	aside := !reaches && reaching > 0
	if aside != l.standingAside {
		l.standingAside = aside
		if aside {
			l.log.Warn("relay: no Kafka broker answers this relay while another relay reaches Kafka; leaving the shards to the relays that do",
				"relays_reaching_kafka", reaching)
		} else {
			l.log.Info("relay: taking a share of the shards again", "reaches_kafka", reaches, "relays_reaching_kafka", reaching)
		}
	}
	switch {
	case aside:
		return 0
	case reaching > 0:
		return (NumShards + reaching - 1) / reaching
	default:
		live = max(live, 1)
		return (NumShards + live - 1) / live
	}
}

// lapse reports no shard owned once the leases may have lapsed without a
// renewal (the database is unreachable): the publish loop already stopped
// publishing them (snapshot), and the owned-shards figure must say so
// rather than keep the last count. It returns how many shards were lost,
// 0 if nothing changed. The next successful tick reports the shards again.
func (l *leases) lapse() int {
	l.mu.Lock()
	n := len(l.owned)
	if l.lapsed || n == 0 || !time.Now().After(l.validUntil) {
		l.mu.Unlock()
		return 0
	}
	l.lapsed = true
	l.mu.Unlock()
	l.obs.ObserveShards(0)
	return n
}

func (l *leases) hasExcess() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.excess > 0
}

// releaseExcess hands back the shards above the fair share, as many as the
// last tick said. The publish loop calls it only with nothing of its own in
// flight (no round read ahead, the last outcome recorded, no side retry):
// their deletes would be refused once the shards are gone.
func (l *leases) releaseExcess(ctx context.Context) error {
	l.mu.Lock()
	n := l.excess
	if n == 0 {
		l.mu.Unlock()
		return nil
	}
	give := slices.Clone(l.owned[len(l.owned)-n:])
	l.owned = l.owned[:len(l.owned)-n]
	l.lose()
	l.excess = 0
	l.releasing = give
	owned := len(l.owned)
	l.mu.Unlock()
	l.at("release")
	_, err := l.st.pool.Exec(ctx, l.st.releaseSQL, l.id, give, l.token)
	l.mu.Lock()
	// Even if it failed: it may have committed.
	l.releases++
	for _, s := range give {
		l.releasedBy[s] = l.releases
	}
	l.releasing = nil
	// Reported either way: the shards are no longer this relay's to
	// publish (a failed hand-back's leases lapse unrenewed), and no later
	// tick changes what would report them. Not over a lapse reported
	// meanwhile (0): the next successful tick reports the shards again.
	lapsed := l.lapsed
	l.mu.Unlock()
	l.at("released")
	if !lapsed {
		l.obs.ObserveShards(owned)
	}
	if err != nil {
		return fmt.Errorf("release shards: %w", err)
	}
	l.log.Info("relay: handed shards back", "shards", len(give), "owned", owned)
	return nil
}

// releaseAll hands back every shard and removes the instance row, in one
// transaction. While the row carries this process's token, the shards
// leased to its id are this process's. A row with another token means a
// successor took the id after this relay's lease lapsed: the shards, the
// rounds and the row are the successor's, and nothing is handed back. No
// row at all (deleted by hand, say) proves nothing about the shards: the
// relay writes the row back with its token for the length of the
// transaction (another process taking the id now waits for it) and hands
// back only the shards still held under its own takes' epochs, so not
// those another process under the same id took since. (Not by the
// leases' end, as before: a renewal whose answer was lost moved it, and
// the stop left those shards leased until they lapsed.)
func (l *leases) releaseAll(ctx context.Context) error {
	l.mu.Lock()
	owned, epochs := l.owned, make([]int64, len(l.owned))
	for i, s := range owned {
		epochs[i] = l.epoch[s]
	}
	l.owned = nil
	l.lose()
	l.mu.Unlock()
	l.obs.ObserveShards(0)
	return pgx.BeginFunc(ctx, l.st.pool, func(tx pgx.Tx) error {
		var ours bool
		switch err := tx.QueryRow(ctx, l.st.ownInstanceSQL, l.id, l.token).Scan(&ours); {
		case errors.Is(err, pgx.ErrNoRows) && !l.claimed:
			// Stopped before its first lease round charged the id's
			// crashed rounds: it took no shard, and the rounds are not
			// its own to forget.
			return nil
		case errors.Is(err, pgx.ErrNoRows):
			switch err := tx.QueryRow(ctx, l.st.instanceBackSQL, l.id, l.host, os.Getpid(), l.token).Scan(&ours); {
			case errors.Is(err, pgx.ErrNoRows):
				l.log.Info("relay: instance id taken by another process: its shards left alone")
				return nil
			case err != nil:
				return fmt.Errorf("write back the instance row: %w", err)
			}
			tag, err := tx.Exec(ctx, l.st.releaseLeasesSQL, l.id, owned, epochs)
			if err != nil {
				return fmt.Errorf("release shards: %w", err)
			}
			l.log.Warn("relay: the instance row was gone (deleted by hand?); handed back the shards this process still held",
				"shards", tag.RowsAffected())
		case err != nil:
			return fmt.Errorf("lock instance: %w", err)
		default:
			if _, err := tx.Exec(ctx, l.st.releaseAllSQL, l.id, l.token); err != nil {
				return fmt.Errorf("release shards: %w", err)
			}
		}
		// A round read ahead but never sent was not cut short: forget it.
		if _, err := tx.Exec(ctx, l.st.forgetRoundsSQL, l.id, l.token); err != nil {
			return fmt.Errorf("clear in-flight span: %w", err)
		}
		if _, err := tx.Exec(ctx, l.st.goodbyeSQL, l.id, l.token); err != nil {
			return fmt.Errorf("remove instance: %w", err)
		}
		return nil
	})
}

// queryShards runs a statement returning shards, their lease_until and
// epoch, noting each shard's lease end in until and its epoch in epochs.
func (l *leases) queryShards(ctx context.Context, until *[NumShards]time.Time, epochs *[NumShards]int64, sql string, args ...any) ([]int16, error) {
	rows, err := l.st.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []int16
	for rows.Next() {
		var s int16
		var t time.Time
		var epoch int64
		if err := rows.Scan(&s, &t, &epoch); err != nil {
			return nil, err
		}
		if s < 0 || int(s) >= NumShards {
			return nil, fmt.Errorf("shard %d out of range", s)
		}
		until[s], epochs[s] = t, epoch
		out = append(out, s)
	}
	return out, rows.Err()
}
