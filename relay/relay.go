package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/migrations"
)

// MessageIDHeader is the record header holding the event id (G4).
const MessageIDHeader = "message-id"

// maxSkipped caps Relay.skipped: how many events above a ceiling the reads
// leave out by id, so that they read on past them to other partitions'
// events. Each read walks past them in the index (and hashes their ids):
// the cost of a read while a ceiling stands grows with them, up to this.
const maxSkipped = 4096

// hotProbes is how many probe intervals a relay keeps reading its shards
// after the probe saw new ids handed out: the transactions that took them
// may commit a little later.
const hotProbes = 20

// Relay publishes committed outbox events to Kafka. Create it with New and
// call Run; a Relay runs once.
type Relay struct {
	events  EventObserver         // Config.Observer's, or nil
	sickObs SickPartitionObserver // Config.Observer's, or nil
	cfg     Config
	pool    *pgxpool.Pool
	pub     Publisher
	parts   PartitionReporter // pub's, or nil
	st      *store
	leases  *leases
	log     *slog.Logger
	ran     atomic.Bool
	beat    atomic.Int64 // unix nanoseconds of the publish loop's last pass

	// The wake-up (publish loop only): the last value the probe read from
	// the outbox's id sequence and whether that id was visible (committed
	// and pending), until when the relay keeps reading after seeing it
	// move, and the highest id it has read.
	lastSeq     int64
	lastVisible bool
	hotUntil    time.Time
	seenID      int64

	// Owned by the publish loop.
	blocked map[string]*keyState
	// ceilings hold, per partition, the id of the first failed event whose
	// key was not held back because Config.MaxHeldKeys was reached: nothing
	// of that partition at or above it is published (but held keys'
	// retries) until they are lifted. ceilingAll is the same for events
	// whose partition the publisher cannot tell; 0 when none.
	ceilings   map[topicPartition]int64
	ceilingAll int64
	// skipped are events a ceiling stopped (belowCeiling dropped them),
	// left out of every read by id while the ceilings stand, at most
	// maxSkipped of them: reads go on past them (see round). skippedKeys
	// are the keys (blockKey) of every event a ceiling stopped, noted also
	// past that cap: no event of theirs goes out before the ceilings lift,
	// on another topic, or whatever partition the publisher reports for it
	// by then (a topic given more partitions). Its size is bound by the
	// keys of the rounds read while the ceilings stand.
	skipped     []int64
	skippedKeys map[string]bool
	// keylessWaits are, per topic with a sick partition, the keyless events
	// that failed with the held keys at their cap (waitKeyless), and
	// keylessIDs how many ids they hold in all.
	keylessWaits map[string]*keylessWait
	keylessIDs   int
	roundBackoff backoff.BackOff
	// The previous round's outcome is recorded while the next round is
	// published; finishing is closed once it is, and finishingIDs are the
	// events that outcome deletes (acknowledged or dead-lettered), which
	// reads must leave out until then. finishingFailed are the keys whose
	// events failed in it (their failures being written).
	finishing       chan struct{}
	finishingIDs    []int64
	finishingFailed map[string]bool
	stopRun         func(error) // ends Run (its context) with a cause
	stmtLoss        statementLoss
	privilegeStop   atomic.Bool // the run was stopped for a missing privilege
	// sideDone delivers the side retry in flight, nil if none (sideretry.go).
	sideDone chan sideResult
	sideSQL  string
	// sick holds the partitions marked sick, by topic (sickpartition.go);
	// owned by the publish loop.
	sick      map[string]map[int32]*sickPartition
	sickCount int
	// sickReported is the count SickPartitionObserver has been told of.
	sickReported int
}

// keyState is a key (or a keyless event) whose event failed and waits for
// its retry; its later events are held back until then.
type keyState struct {
	key      []byte
	keyless  bool
	firstID  int64
	retryAt  time.Time
	backoff  backoff.BackOff
	lastSeen time.Time
	// timedOut: the key's event was not acknowledged in time; the side retry
	// retries it (at sideAt) beside the rounds, which leave the key out
	// until then (retryAt is farFuture).
	timedOut bool
	onSide   bool
	sideAt   time.Time
	// part is the partition of the key (hasPart: the publisher told it).
	part    topicPartition
	hasPart bool
}

// farFuture is the retryAt of a key the side retry is in charge of.
var farFuture = time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC)

// New returns a relay reading from pool's database and publishing through
// pub. cfg may be nil. The relay does not close pool or pub.
func New(pool *pgxpool.Pool, pub Publisher, cfg *Config) (*Relay, error) {
	if pool == nil {
		return nil, errors.New("relay: pool is nil")
	}
	if pub == nil {
		return nil, errors.New("relay: publisher is nil")
	}
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	st := newStore(pool, c.Schema)
	events, _ := c.Observer.(EventObserver)
	sickObs, _ := c.Observer.(SickPartitionObserver)
	parts, _ := pub.(PartitionReporter)
	st.maxBytes = int64(c.BatchBytes)
	lz := newLeases(st, c.InstanceID, c.LeaseDuration, c.Observer, c.Logger.With("instance", c.InstanceID))
	st.token = lz.token
	st.recordLockWait = strconv.FormatInt((5 * c.LeaseDuration).Milliseconds(), 10)
	return &Relay{
		events:       events,
		sickObs:      sickObs,
		cfg:          c,
		pool:         pool,
		pub:          pub,
		parts:        parts,
		sick:         map[string]map[int32]*sickPartition{},
		ceilings:     map[topicPartition]int64{},
		skippedKeys:  map[string]bool{},
		keylessWaits: map[string]*keylessWait{},
		st:           st,
		leases:       lz,
		log:          c.Logger.With("instance", c.InstanceID),
		blocked:      map[string]*keyState{},
		roundBackoff: newBackoff(c.MaxRetryBackoff),
		sideSQL:      sideSQL(c.Schema),
	}, nil
}

// InstanceID returns the name this relay uses in relay_instances.
func (r *Relay) InstanceID() string { return r.cfg.InstanceID }

// OwnedShards returns the shards this relay holds a lease on now, sorted
// (none before Run took any, or once the leases may have lapsed). Safe for
// concurrent use.
func (r *Relay) OwnedShards() []int16 { return r.leases.snapshot() }

// LastLoop is when the publish loop last began a pass: a round, or an idle
// wait of at most PollInterval. It is zero before Run gets past its start
// checks. A pass waits as long as Kafka takes to acknowledge a round, so a
// liveness check should allow for that (see the binary's /livez). Safe for
// concurrent use.
func (r *Relay) LastLoop() time.Time {
	if n := r.beat.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// Run publishes until ctx is done, then gives the round it has with Kafka
// up to 5 s more to be acknowledged and records its outcome (what is not
// acknowledged by then stays pending, for the next owner), hands its shards
// back and returns nil (nil too for a stop while it is still starting). It
// returns an error at once if the outbox cannot be read at start (database
// unreachable, schema not migrated), and an
// *InstanceInUseError if a live relay holds the same InstanceID (at start,
// or later if this relay's lease lapsed and another process took the id:
// then it stops publishing at once and hands nothing back). Later database
// and broker failures are logged and retried: events are never lost or
// dead-lettered because of them. The exceptions, which retrying does not
// mend: a pool that talks to a pooler whose server connections do not keep
// the statements pgx prepares on them (transaction mode, without
// default_query_exec_mode=exec) ends the run with an error wrapping
// ErrPreparedStatementsLost, and a role that lacks a privilege the relay
// needs with one wrapping ErrInsufficientPrivilege, at start or once seen
// (the round with Kafka gets its stop's grace, the shards are handed back).
// A pool in exec or simple_protocol mode on a database whose bytea_output
// or DateStyle pgx cannot read as text is refused at start with an error
// wrapping ErrTextResultSettings, and a pool whose sessions do not default
// to READ COMMITTED with one wrapping ErrIsolationSetting.
func (r *Relay) Run(ctx context.Context) error {
	if !r.ran.CompareAndSwap(false, true) {
		return errors.New("relay: Run called twice")
	}
	if err := r.checkSchema(ctx); err != nil {
		return stoppedWhileStarting(ctx, err)
	}
	if err := checkTextSettings(ctx, r.pool); err != nil {
		if errors.Is(err, ErrTextResultSettings) {
			r.log.Error("relay: refusing to start: the database writes results as text pgx cannot read", "error", err)
		}
		return stoppedWhileStarting(ctx, err)
	}
	if err := checkIsolation(ctx, r.pool); err != nil {
		if errors.Is(err, ErrIsolationSetting) {
			r.log.Error("relay: refusing to start: its sessions do not default to READ COMMITTED", "error", err)
		}
		return stoppedWhileStarting(ctx, err)
	}
	r.warnOfNewerMigrations(ctx)
	stopWatch := r.watchKafka(ctx)
	defer stopWatch()
	if err := r.start(ctx); err != nil {
		if err = stoppedWhileStarting(ctx, err); err == nil {
			// A first lease round cut short may have written the instance
			// row and taken shards (its statements commit one by one).
			r.handBack()
		}
		return err
	}
	r.log.Info("relay started", "schema", r.cfg.Schema)
	// The lease loop ends the run if another process takes this
	// relay's instance id; noteDBError if a pooler loses its prepared
	// statements or the schema loses a migration under the relay.
	ctx, r.stopRun = context.WithCancelCause(ctx)
	defer r.stopRun(nil)

	var wg sync.WaitGroup
	bg, stopBackground := context.WithCancel(context.Background())
	wg.Add(1)
	go func() { defer wg.Done(); r.leaseLoop(bg) }()

	r.publishLoop(ctx)
	r.waitFinish()
	r.finishSideRetry(ctx, true)
	// A stopped relay holds no partition sick: what it reported is taken
	// back from the Observer (which other relays may share).
	clear(r.sick)
	r.sickCount = 0
	r.sickChanged()

	stopBackground()
	wg.Wait()
	var inUse *InstanceInUseError
	if errors.As(context.Cause(ctx), &inUse) {
		// The shards and the instance row are the other process's now.
		return inUse
	}
	var stopErr error
	var missing *migrations.MissingError
	if cause := context.Cause(ctx); errors.Is(cause, ErrPreparedStatementsLost) || errors.Is(cause, ErrInsufficientPrivilege) || errors.As(cause, &missing) {
		stopErr = cause
	}
	r.handBack()
	r.log.Info("relay stopped")
	return stopErr
}

// sleepUnlessShardsChange waits d, or less if ctx ends or the leases
// signal a change of shards (the signal is taken: the loop reads the
// shards next).
func (r *Relay) sleepUnlessShardsChange(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	case <-r.leases.changed:
	}
}

// pinger is what a Publisher offers to tell whether a broker answers;
// both of onceflow's publishers have it.
type pinger interface {
	Ping(ctx context.Context) error
}

// watchKafka pings the publisher's brokers every lease tick, so that the
// leases know whether this relay reaches Kafka (KafkaHandoff): a relay cut
// off from the brokers but not from PostgreSQL would otherwise keep its
// shards, and their events would wait, while another relay could publish
// them. The first ping is waited for (up to a tick), so that a relay
// started cut off takes no shard from one that reaches Kafka; a relay
// counts as not reaching Kafka until a broker answered. The later pings run
// beside the lease ticks, never in them: a broker that drops packets must
// not hold up a renewal. Each ping may take up to KafkaHandoff: a slow
// broker still answers. A Publisher without Ping counts as reaching Kafka.
// The returned function stops the watch.
func (r *Relay) watchKafka(ctx context.Context) (stop func()) {
	p, ok := r.pub.(pinger)
	if !ok {
		return func() {}
	}
	var lastAnswer atomic.Int64 // unix ns; 0: none yet
	r.leases.reachesKafka = func() bool {
		at := lastAnswer.Load()
		return at != 0 && time.Since(time.Unix(0, at)) < r.cfg.KafkaHandoff
	}
	ping := func(ctx context.Context) {
		pctx, cancel := context.WithTimeout(ctx, r.cfg.KafkaHandoff)
		defer cancel()
		if err := p.Ping(pctx); err == nil {
			lastAnswer.Store(time.Now().UnixNano())
		}
	}
	watchCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan struct{})
	first := make(chan struct{})
	go func() {
		defer close(done)
		every := r.leases.interval()
		t := time.NewTicker(every)
		defer t.Stop()
		ping(watchCtx)
		close(first)
		for {
			select {
			case <-watchCtx.Done():
				return
			case <-t.C:
			}
			ping(watchCtx)
		}
	}()
	wait := time.NewTimer(r.leases.interval())
	defer wait.Stop()
	select {
	case <-first:
	case <-wait.C:
	case <-ctx.Done():
	}
	return func() { cancel(); <-done }
}

// handBack gives back this process's shards and instance row at a stop
// (releaseAll checks the row still carries its token).
func (r *Relay) handBack() {
	release, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := r.leases.releaseAll(release); err != nil {
		// The leases lapse on their own within LeaseDuration.
		r.log.Warn("relay: hand back shards at shutdown", "error", err)
	}
}

// start takes the instance id and the first shards. The database answered
// the schema check, so other failures are passing and retried. An instance
// row of the same id that has not lapsed yet is waited for (a restart under
// a fixed id finds its killed predecessor's), and refused only once its
// heartbeat is seen to advance: then a live relay renews it. How long the
// wait or a tick takes says nothing about that: a tick that straddles the
// lapse of a dead relay's row and runs long (a slow database) still sees
// the row unexpired, and the row lapses by itself since nobody renews it.
func (r *Relay) start(ctx context.Context) error {
	bo := newBackoff(time.Second)
	var seen time.Time // the holder's heartbeat when first refused
	for {
		err := r.leases.tick(ctx)
		var inUse *InstanceInUseError
		switch {
		case err == nil:
			return nil
		case errors.As(err, &inUse):
			switch {
			case inUse.Heartbeat.IsZero():
				// The row went between the two reads: try again.
			case seen.IsZero():
				seen = inUse.Heartbeat
				r.log.Warn("relay: instance id held by another relay; waiting for its lease to lapse (a killed relay's does), refusing if it is renewed",
					"host", inUse.Hostname, "pid", inUse.PID, "heartbeat", inUse.Heartbeat)
			case !inUse.Heartbeat.Equal(seen):
				r.log.Error("relay: refusing to start: instance id in use by a live relay", "error", err)
				return err
			}
		case ctx.Err() != nil:
			return fmt.Errorf("relay: first lease round: %w", err)
		default:
			if stop := r.stmtLoss.check(r.pool, err); stop != nil {
				return stop
			}
			if isInsufficientPrivilege(err) {
				r.log.Error("relay: refusing to start: the database role lacks a privilege the relay needs", "error", err)
				return fmt.Errorf("%w: %w", ErrInsufficientPrivilege, err)
			}
			if isReadOnly(err) {
				// A standby before its promotion, or a role or database
				// that defaults to read-only: waiting mends the first,
				// the operator the second.
				r.log.Warn("relay: first lease round failed: the database is read-only (a hot standby, or default_transaction_read_only on); retrying until it accepts writes", "error", err)
			} else {
				r.log.Warn("relay: first lease round failed; retrying", "error", err)
			}
		}
		sleep(ctx, min(bo.NextBackOff(), r.leases.interval()))
	}
}

// stoppedWhileStarting is nil for a start that failed because ctx ended (a
// stop while waiting for a held instance id or retrying a first lease
// round), and err otherwise. A refusal (the id is in use, the pooler loses
// statements) is reported whatever ctx says.
func stoppedWhileStarting(ctx context.Context, err error) error {
	var inUse *InstanceInUseError
	if ctx.Err() != nil && !errors.As(err, &inUse) && !errors.Is(err, ErrPreparedStatementsLost) && !errors.Is(err, ErrInsufficientPrivilege) && !errors.Is(err, ErrTextResultSettings) && !errors.Is(err, ErrIsolationSetting) {
		return nil
	}
	return err
}

// warnOfNewerMigrations says when the schema holds migrations this build
// does not know. The relay runs on (migrations are additive, so a rolling
// upgrade has old relays on a new schema), but after a release rolled back
// without its migrations the operator should know the schema is ahead.
func (r *Relay) warnOfNewerMigrations(ctx context.Context) {
	newer, err := migrations.Newer(ctx, r.pool, r.cfg.Schema)
	switch {
	case err != nil:
		r.log.Debug("relay: read the schema's migration versions", "error", err)
	case len(newer) > 0:
		r.log.Warn("relay: the schema holds migrations a newer onceflow applied, which this relay does not know; "+
			"fine while a rolling upgrade is under way, otherwise upgrade this relay or revert them with the newer onceflow",
			"schema", r.cfg.Schema, "versions", newer)
	}
}

func (r *Relay) checkSchema(ctx context.Context) error {
	if err := migrations.Check(ctx, r.pool, r.cfg.Schema); err != nil {
		if stop := r.stmtLoss.check(r.pool, err); stop != nil {
			return stop
		}
		if isInsufficientPrivilege(err) {
			return fmt.Errorf("%w: %w", ErrInsufficientPrivilege, err)
		}
		return fmt.Errorf("relay: %w", err)
	}
	// The probe reads the sequence behind outbox.id (quoted by the server).
	table := pgx.Identifier{r.cfg.Schema, "outbox"}.Sanitize()
	var seq *string
	if err := r.pool.QueryRow(ctx, `SELECT pg_get_serial_sequence($1, 'id')`, table).Scan(&seq); err != nil {
		if stop := r.stmtLoss.check(r.pool, err); stop != nil {
			return stop
		}
		if isInsufficientPrivilege(err) {
			return fmt.Errorf("%w: find the id sequence of %s: %w", ErrInsufficientPrivilege, table, err)
		}
		return fmt.Errorf("relay: find the id sequence of %s: %w", table, err)
	}
	if seq == nil {
		return fmt.Errorf("relay: %s.id has no sequence; is the schema migrated? run `onceflow migrate up`", table)
	}
	r.st.probeSQL = `SELECT s.v, EXISTS (SELECT 1 FROM ` + table + ` o WHERE o.id = s.v)
FROM (SELECT CASE WHEN is_called THEN last_value ELSE 0 END AS v FROM ` + *seq + `) s`
	// A check that could not run (a short statement_timeout on a busy
	// server) is no reason not to start: every lease tick checks again.
	if err := r.checkRowSecurity(ctx); errors.Is(err, ErrInsufficientPrivilege) {
		return err
	} else if err != nil {
		r.log.Warn("relay: could not check row-level security at start; the lease ticks will", "error", err)
	}
	return nil
}

// checkRowSecurity returns an error wrapping ErrInsufficientPrivilege when
// row-level security applies to the relay's role on its tables. Such
// security hides rows from every statement without an error: the relay
// published nothing, and its backlog read 0, so no alert fired. It runs at
// start and on every lease tick, since it can be switched on under a
// running relay.
func (r *Relay) checkRowSecurity(ctx context.Context) error {
	var hidden []string
	if err := r.pool.QueryRow(ctx, rowSecuritySQL, r.cfg.Schema).Scan(&hidden); err != nil {
		return fmt.Errorf("relay: check row-level security: %w", err)
	}
	if len(hidden) > 0 {
		return fmt.Errorf("%w: row-level security applies to this relay's role on %s.%s, and a policy can hide rows the relay must publish without an error (not supported; README, \"Roles and privileges\"): "+
			"disable it on those tables, or run the relay as their owner or a role with BYPASSRLS", ErrInsufficientPrivilege, r.cfg.Schema, strings.Join(hidden, ", "))
	}
	return nil
}

// rowSecuritySQL names the relay's tables in schema $1 whose row-level
// security applies to the current role: not a superuser nor BYPASSRLS, and
// not the table's owner unless FORCE ROW LEVEL SECURITY. The consumer's
// and the middleware's tables are not the relay's concern.
const rowSecuritySQL = `SELECT coalesce(array_agg(c.relname::text ORDER BY c.relname), '{}')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') AND c.relrowsecurity
    AND c.relname IN ('outbox', 'outbox_dead', 'relay_shards', 'relay_instances', 'relay_rounds', 'schema_migrations')
    AND (c.relforcerowsecurity OR NOT pg_has_role(c.relowner, 'USAGE'))
    AND NOT (SELECT rolsuper OR rolbypassrls FROM pg_roles WHERE rolname = current_user)`

func (r *Relay) leaseLoop(ctx context.Context) {
	t := time.NewTicker(r.leases.interval())
	defer t.Stop()
	tickBound := max(2*r.cfg.LeaseDuration, 5*time.Second)
	failing := false
	// rlsUnchecked: the last tick's row-level security check could not run
	// (logged once, until one runs again).
	rlsUnchecked := false
	for n := 0; ; n++ {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-r.leases.recheck:
			t.Reset(r.leases.interval())
		}
		// A tick that hangs (a database that drops packets) must not stop
		// the leases from being reported lapsed: give up after twice the
		// lease (at least 5s), long after they lapsed, and try again.
		tickCtx, cancel := context.WithTimeout(ctx, tickBound)
		err := r.leases.tick(tickCtx)
		cancel()
		switch {
		case ctx.Err() != nil:
			return
		case errors.As(err, new(*InstanceInUseError)):
			// Our lease lapsed and another process took the id: it owns
			// our shards now. Stop at once.
			r.leases.lapse()
			r.log.Error("relay: stopping: another relay took this instance id", "error", err)
			r.stopRun(err)
			return
		case err != nil:
			failing = true
			r.log.Warn("relay: lease upkeep failed; shards lapse unless it recovers", "error", err)
			r.noteDBError(err)
			if lost := r.leases.lapse(); lost > 0 {
				if isReadOnly(err) {
					r.log.Warn("relay: shard leases lapsed; publishing paused while the database is read-only (a standby after a failover?)", "shards", lost)
				} else {
					r.log.Warn("relay: shard leases lapsed; publishing paused until the database answers", "shards", lost)
				}
			}
		case failing:
			failing = false
			r.log.Info("relay: lease upkeep recovered", "shards", len(r.leases.snapshot()))
		}
		// The statements after the tick are bounded like it: a hung
		// connection must not hold the lease loop.
		if err == nil {
			checkCtx, cancel := context.WithTimeout(ctx, tickBound)
			err := r.checkRowSecurity(checkCtx)
			cancel()
			switch {
			case errors.Is(err, ErrInsufficientPrivilege):
				r.log.Error("relay: stopping", "error", err)
				r.stopRun(err)
				return
			case err != nil && !rlsUnchecked && ctx.Err() == nil:
				rlsUnchecked = true
				r.log.Warn("relay: could not check row-level security; will retry at every lease tick", "error", err)
			case err == nil && rlsUnchecked:
				rlsUnchecked = false
				r.log.Info("relay: row-level security checked again")
			}
		}
		if n%100 == 0 {
			forgetCtx, cancel := context.WithTimeout(ctx, tickBound)
			_, _ = r.pool.Exec(forgetCtx, r.st.forgetOldSQL)
			cancel()
		}
	}
}

func (r *Relay) publishLoop(ctx context.Context) {
	var ahead *prefetch
	for ctx.Err() == nil {
		r.beat.Store(time.Now().UnixNano())
		r.finishSideRetry(ctx, false)
		// Shards are handed back only once nothing of this relay's touches
		// them: no round read ahead, no outcome being recorded, no side
		// retry in flight (their deletes check the lease). A hand-back
		// waits for the side retry in flight (the rounds go on meanwhile)
		// and starts no new one. The excess is read once: a tick may set
		// it at any time, and releaseExcess is called only here, after the
		// wait.
		excess := r.leases.hasExcess()
		if !excess {
			r.startSideRetry(ctx)
		}
		if excess && r.sideDone == nil {
			if ahead != nil { // it may hold events of shards about to go
				r.forgetRound(ctx, ahead.round)
				ahead = nil
			}
			r.waitFinish() // and their deletes still need the lease
			if err := r.leases.releaseExcess(ctx); err != nil && ctx.Err() == nil {
				r.log.Warn("relay: hand back shards", "error", err)
			}
		}
		shards, losses := r.leases.held()
		if ahead != nil && (ahead.losses != losses || !slices.Equal(ahead.shards, shards)) {
			r.forgetRound(ctx, ahead.round)
			ahead = nil // ownership changed since it was read
		}
		if len(shards) == 0 {
			if r.sickCount > 0 {
				// No round runs to drop the marks of partitions whose
				// keys went with the shards.
				r.forgetUnprobedSick()
			}
			r.idle(ctx)
			continue
		}
		res, next, err := r.round(ctx, shards, losses, ahead)
		ahead = next
		switch {
		case err != nil && ctx.Err() == nil:
			wait := r.roundBackoff.NextBackOff()
			r.log.Warn("relay: publish round failed", "error", err, "backoff", wait)
			r.noteDBError(err)
			sleep(ctx, wait)
		case res.claimed > res.held && res.acked == 0 && res.dead == 0 && res.failedKeys > 1:
			// Everything failed, for more than one key: the broker is
			// likely down. Don't spin. (One key failing, the rest of the
			// round its own events held back behind it, is that key's
			// trouble: it waits out its own backoff, and the other keys
			// are read at once.) A change of shards ends the wait: a
			// relay cut off from Kafka hands its shards over at once.
			wait := r.roundBackoff.NextBackOff()
			r.debugRound(ctx, len(shards), res, next != nil, "backoff", wait)
			r.sleepUnlessShardsChange(ctx, wait)
		case res.whole:
			r.roundBackoff.Reset()
			// More may be waiting: go again at once.
			r.debugRound(ctx, len(shards), res, next != nil, "at_once", 0)
		default:
			r.roundBackoff.Reset()
			if res.claimed > 0 {
				r.debugRound(ctx, len(shards), res, next != nil, "idle", 0)
			}
			r.idle(ctx)
		}
	}
}

// idle waits until there may be events to read: the probe saw new ids
// handed out (or saw them recently and the relay has not read that far
// yet), the shards changed, a blocked key's retry is due, or PollInterval
// passed, whichever comes first. Between looks it probes every
// ProbeInterval: one read of the outbox's id sequence, which costs writers
// nothing (no trigger, no NOTIFY) and does not grow with the backlog or the
// dead rows a drain leaves behind.
func (r *Relay) idle(ctx context.Context) {
	now := time.Now()
	deadline := now.Add(r.cfg.PollInterval)
	for _, k := range r.blocked {
		if k.retryAt.After(now) && k.retryAt.Before(deadline) {
			deadline = k.retryAt
		}
	}
	if _, next := r.sideDue(now); !next.IsZero() && next.Before(deadline) {
		deadline = next
	}
	woken := "poll"
	if deadline.Before(now.Add(r.cfg.PollInterval)) {
		woken = "key_retry"
	}
	defer func() {
		if r.log.Enabled(ctx, slog.LevelDebug) {
			r.log.LogAttrs(ctx, slog.LevelDebug, "relay: idle", slog.String("woken_by", woken), slog.Duration("waited", time.Since(now)))
		}
	}()
	t := time.NewTimer(0)
	defer t.Stop()
	<-t.C
	for {
		wait := min(r.cfg.ProbeInterval, time.Until(deadline))
		if wait > 0 {
			t.Reset(wait)
			select {
			case <-ctx.Done():
				return
			case <-r.leases.changed:
				woken = "shards"
				return
			case res := <-r.sideDone: // nil (never ready) when none is in flight
				r.sideDone <- res // finishSideRetry takes it
				woken = "side_retry"
				return
			case <-t.C:
			}
		}
		now := time.Now()
		if !now.Before(deadline) {
			return
		}
		if now.Before(r.hotUntil) {
			woken = "recent_ids"
			return
		}
		if r.probe(ctx) {
			woken = "probe"
			return
		}
	}
}

// probe reports whether there may be new events: the newest id handed out
// is visible (committed) and above every id read so far. New ids also make
// the relay read on every probe for the next hotProbes intervals, whether or
// not the newest is visible yet: an older id may commit after it, or the
// newest may have been rolled back. An error reports false: it used up a
// broken pool connection (which the round's statements would otherwise
// meet and back off for), and if the database stays unreachable the poll
// at PollInterval surfaces it.
func (r *Relay) probe(ctx context.Context) bool {
	var v int64
	var visible bool
	if err := r.pool.QueryRow(ctx, r.st.probeSQL).Scan(&v, &visible); err != nil {
		r.noteDBError(err)
		return false
	}
	r.lastVisible = visible
	if v != r.lastSeq {
		r.lastSeq = v
		r.hotUntil = time.Now().Add(hotProbes * r.cfg.ProbeInterval)
	}
	return visible && v > r.seenID
}

// saw notes the highest id read.
func (r *Relay) saw(events []pendingEvent) {
	if n := len(events); n > 0 && events[n-1].id > r.seenID {
		r.seenID = events[n-1].id
	}
}

// debugRound logs a round's outcome and what the loop does next, at debug
// level (and costs nothing above it).
func (r *Relay) debugRound(ctx context.Context, shards int, res roundResult, readAhead bool, next string, wait time.Duration) {
	if !r.log.Enabled(ctx, slog.LevelDebug) {
		return
	}
	attrs := []slog.Attr{
		slog.Int("claimed", res.claimed), slog.Int("published", res.acked),
		slog.Int("failed", res.claimed-res.acked-res.dead), slog.Int("dead_lettered", res.dead),
		slog.String("next", next),
	}
	if wait > 0 {
		attrs = append(attrs, slog.Duration("backoff", wait))
	}
	attrs = append(attrs, slog.Int("shards", shards), slog.Bool("read_ahead", readAhead))
	r.log.LogAttrs(ctx, slog.LevelDebug, "relay: round", attrs...)
}

type roundResult struct {
	claimed, acked, dead int
	// whole: the claim read a whole round (BatchSize events, or fewer
	// where it dropped held keys' events from what it read: store.lastFull;
	// what the relay then left out, behind a ceiling or a key that waits,
	// does not count): more may be waiting.
	whole      bool
	held       int // not sent: their partition is sick
	failedKeys int // keys (and keyless events) that failed
}

// prefetch is the next round, read while the current one was with Kafka.
type prefetch struct {
	shards []int16
	losses uint64 // the leases' (held), when read
	events []pendingEvent
	round  roundKey // its relay_rounds row
	whole  bool     // the read was a whole round (store.lastFull)
}

// round publishes one batch: claim the oldest pending events of the owned
// shards (recording them as in flight), publish them, wait for every ack,
// then delete exactly the acknowledged ones, dead-letter the refused ones
// and hold back the keys of the ones that failed.
//
// While a whole round is with Kafka, the next round is read (excluding this
// one's events) so the database and the broker work at the same time. It is
// published only after this round's outcome is known, and its events of
// keys that just failed are left out, so a key's events still go out in
// order and stop at the first failure.
//
// losses is the leases' count when shards was taken (leases.held): the
// round is published only while they still hold (leases.stillHeld).
func (r *Relay) round(ctx context.Context, shards []int16, losses uint64, ahead *prefetch) (roundResult, *prefetch, error) {
	start := time.Now()
	if r.liftCeiling() && ahead != nil {
		// The read ahead left out the events the ceilings stopped and
		// may hold later events of their keys: without the ceilings,
		// those would go out first (G3). Read afresh instead.
		r.forgetRound(ctx, ahead.round)
		ahead = nil
	}
	if r.sickCount > 0 {
		r.forgetUnprobedSick()
	}
	// After forgetUnprobedSick, which may clear a topic's last sick mark.
	r.releaseKeyless()
	keys, ids := r.exclusions(start)
	var events []pendingEvent
	var round roundKey
	whole := false // see roundResult
	if ahead != nil {
		round = ahead.round
		events = r.belowCeiling(r.withoutBlocked(ahead.events, start))
		whole = ahead.whole
		if len(events) == 0 {
			r.forgetRound(ctx, round)
		}
	} else {
		// A fresh read must not see the rows the last round's outcome is
		// recording. It leaves out those it deletes, as a read-ahead does,
		// rather than wait for them: after a round that failed whole for
		// a key not yet known to be stuck, that wait (an UPDATE of a
		// round of rows) was on every other key's path. The failed rows
		// cannot be read while their keys are held back (exclusions, at
		// the same instant); if one is not, the read waits, so that a
		// retry reads its event with this failure recorded (attempts,
		// refusal run).
		if !r.finishingHeld(start) || r.finished() {
			r.waitFinish()
		}
		excluded := ids
		if len(r.finishingIDs) > 0 {
			excluded = append(slices.Clip(ids), r.finishingIDs...)
		}
		seq := r.lastSeq
		var err error
		events, err = r.st.claim(ctx, r.cfg.InstanceID, shards, r.cfg.BatchSize, keys, r.withSkipped(excluded))
		if err != nil {
			return roundResult{}, nil, fmt.Errorf("relay: read pending events: %w", err)
		}
		r.forgetLostRetries(start, events, excluded)
		for len(events) > 0 {
			r.saw(events)
			round = keyOf(events)
			noted := len(r.skipped)
			kept := r.belowCeiling(events)
			whole = r.st.lastFull
			if len(kept) > 0 {
				events = kept
				break
			}
			r.forgetRound(ctx, round)
			if len(r.skipped)-noted < len(events) {
				// maxSkipped reached: what lies past these waits
				// for the ceilings to lift.
				events = kept
				break
			}
			// Every event read is above a ceiling (they are left out of
			// reads from now on): read on past them, or the other
			// partitions' events behind them are never read while the
			// ceiling stands. Not a cursor: the read starts from the
			// oldest pending event again, leaving out exact ids.
			events, err = r.st.claim(ctx, r.cfg.InstanceID, shards, r.cfg.BatchSize, keys, r.withSkipped(excluded))
			if err != nil {
				return roundResult{}, nil, fmt.Errorf("relay: read pending events: %w", err)
			}
		}
		if len(events) == 0 && seq > r.seenID && r.lastVisible {
			// Nothing this relay may read up to the last id probed, though
			// it was visible (what is pending is held keys' later events,
			// or events above a ceiling): the probe must not wake the
			// relay for those ids again, only for newer ones. An id not
			// visible yet may still commit: the probe wakes the relay
			// when it does.
			r.seenID = seq
		}
	}
	r.saw(events)
	if len(events) == 0 {
		return roundResult{}, nil, nil
	}
	if !r.leases.stillHeld(losses) {
		// The leases may have lapsed since the read (its statements
		// stalled): the shards' owner now publishes these events.
		r.forgetRound(ctx, round)
		r.leases.recheckSoon()
		return roundResult{}, nil, nil
	}
	claimed := len(events)
	events = oneTopicPerKey(events)
	records := make([]Record, len(events))
	msgIDs := make([]Header, len(events)) // the message-id headers
	for i := range events {
		records[i] = toRecordIn(&events[i], msgIDs[i:i+1])
	}
	// The events of keys whose partition is sick are not sent: they would
	// make the round wait out PublishTimeout.
	errs := make([]error, len(records))
	send, held := r.holdSick(events, errs)
	toSend := records
	if held > 0 {
		toSend = make([]Record, len(send))
		for j, i := range send {
			toSend[j] = records[i]
		}
	}
	published := make(chan []error, 1)
	pubCtx, donePub := r.publishContext(ctx, losses)
	defer donePub()
	if len(toSend) == 0 {
		published <- nil
	} else {
		go func() { published <- r.pub.Publish(pubCtx, toSend) }()
	}

	var next *prefetch
	if whole {
		// Nor may the read ahead meet an event that failed in the last
		// round before that failure is recorded (see the fresh read): a
		// key of it may be due already if the last round's end waited
		// for the record before it past the key's backoff.
		if !r.finishingHeld(start) || r.readAheadWaits(shards) {
			r.waitFinish()
		}
		inFlight := make([]int64, 0, len(ids)+len(events)+len(r.finishingIDs))
		inFlight = append(append(inFlight, ids...), r.finishingIDs...)
		for i := range events {
			inFlight = append(inFlight, events[i].id)
		}
		nextEvents, err := r.st.claim(ctx, r.cfg.InstanceID, shards, r.cfg.BatchSize, keys, r.withSkipped(inFlight))
		if err == nil {
			r.forgetLostRetries(start, nextEvents, inFlight)
		}
		if err == nil && len(nextEvents) > 0 {
			next = &prefetch{shards: shards, losses: losses, events: nextEvents, round: keyOf(nextEvents), whole: r.st.lastFull}
		}
	}
	sent := <-published
	if len(sent) != len(toSend) {
		if next != nil {
			r.forgetRound(ctx, next.round)
		}
		return roundResult{claimed: claimed}, nil, fmt.Errorf("relay: publisher returned %d results for %d records", len(sent), len(toSend))
	}
	for j, i := range send {
		errs[i] = sent[j]
	}

	o := r.judge(ctx, pubCtx, losses, events, records, errs)
	if r.events != nil {
		r.observeAcked(events, o.acked, start, time.Now())
	}
	acked, dead, failedKeys, deadKeys := o.acked, o.dead, o.failedKeys, o.deadKeys
	if next != nil && (len(failedKeys) > 0 || len(deadKeys) > 0) {
		// The round read ahead must not carry a failed key past its
		// failure; those events stay pending for the key's retry. Nor
		// a dead-lettered key past its dead letter before that is
		// recorded (below).
		kept := next.events[:0:0]
		for i := range next.events {
			if bk := blockKey(&next.events[i]); !failedKeys[bk] && !deadKeys[bk] {
				kept = append(kept, next.events[i])
			}
		}
		next.events = kept
		if len(kept) == 0 {
			r.forgetRound(ctx, next.round)
			next = nil
		}
	}
	if len(r.blocked) > 0 {
		var buf []byte
		for i := range events {
			buf = appendBlockKey(buf[:0], &events[i])
			if k := r.blocked[string(buf)]; k != nil && !failedKeys[string(buf)] && !k.timedOut {
				delete(r.blocked, string(buf)) // the side retry keeps its own keys
			}
		}
		r.forgetStaleBlocks(start)
	}

	// Until the outcome is recorded, reads leave out the events it
	// deletes. The failed ones stay pending and readable, so that once
	// their key's backoff has passed they are read again ahead of the
	// key's later events (leaving them out too let a read-ahead publish a
	// key's later event first).
	gone := make([]int64, 0, len(acked)+len(dead))
	gone = append(gone, acked...)
	for _, d := range dead {
		gone = append(gone, d.id)
	}
	// Record the outcome while the next round goes to Kafka. One outcome
	// is recorded at a time, in round order.
	r.waitFinish()
	done := make(chan struct{})
	r.finishing, r.finishingIDs, r.finishingFailed = done, gone, failedKeys
	go func() {
		defer close(done)
		r.record(ctx, start, o, shards, losses, round)
	}()
	if len(dead) > 0 {
		// A dead-lettered event's key goes on only once the dead letter
		// is recorded. Had its statement failed (or this relay died
		// first), the event would still be pending and, its topic
		// created meanwhile, be published after its key's later events
		// (G3). Dead letters are rare: the rounds wait for them.
		r.waitFinish()
	}
	return roundResult{claimed: claimed, whole: whole, acked: len(acked), dead: len(dead), held: held, failedKeys: len(failedKeys)}, next, nil
}

// record writes a round's outcome: even when ctx is done, since
// acknowledged events must not be published again needlessly, but once it
// is (a stop) for stopGrace at most, as the publish: a lock on the outbox
// (a migration, VACUUM FULL) held the stop for the whole 30 s, past an
// orchestrator's grace. A failure leaves the events pending: they are
// published again (duplicates, not loss).
func (r *Relay) record(ctx context.Context, start time.Time, o outcome, shards []int16, losses uint64, round roundKey) {
	acked, failed := o.acked, o.failed
	var epochs []int64
	if len(o.dead) > 0 {
		// Refused events are moved only on shards held, in the database,
		// under the takes they were read under: nil if they may have
		// been lost since, and the events stay for the shards' owner.
		epochs = r.leases.epochsOf(losses, shards)
	}
	finishCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	stopWatch := context.AfterFunc(ctx, func() {
		t := time.NewTimer(stopGrace)
		defer t.Stop()
		select {
		case <-t.C:
			cancel()
		case <-finishCtx.Done():
		}
	})
	defer stopWatch()
	f, err := r.st.finish(finishCtx, r.cfg.InstanceID, shards, epochs, acked, o.dead, failed, round)
	stats := BatchStats{
		Published:              int(f.deleted),
		Failed:                 len(failed),
		TimedOut:               o.timedOut,
		HeldBack:               o.held,
		SickPartitions:         o.sickPartitions,
		SickPartitionsReported: r.sickObs != nil,
		DeadLettered:           int(f.deadMoved),
		NotDeleted:             int(f.leftToOthers),
		Duration:               time.Since(start),
		OldestCreatedAt:        o.oldest,
	}
	if err != nil {
		stats.Published, stats.NotDeleted, stats.DeadLettered = 0, 0, 0
		r.log.Warn("relay: events were published but their outcome could not be recorded; they will be published again",
			"events", len(acked), "error", err)
		r.noteDBError(err)
	}
	r.cfg.Observer.ObserveBatch(stats)
	if stats.NotDeleted > 0 {
		r.log.Warn("relay: lost shard ownership mid-round; the new owner republishes", "events", stats.NotDeleted)
	}
	gone := len(acked) - stats.Published - stats.NotDeleted
	if err == nil && gone > 0 {
		r.log.Warn("relay: published events were no longer in the outbox: deleted by hand, or published again by a relay that took their shard",
			"events", gone)
	}
	deadLeft := len(o.dead) - stats.DeadLettered
	if err == nil && deadLeft > 0 {
		r.log.Warn("relay: refused events were not moved to outbox_dead: their shard has another owner now (which retries them), or they were deleted",
			"events", deadLeft)
	}
	if err == nil && (stats.Published < len(acked) || deadLeft > 0) {
		// A shard may have changed hands: until a lease tick says which,
		// the rounds would read and publish its events again.
		r.leases.recheckSoon()
	}
	if o.timedOut > 0 {
		r.log.Warn("relay: events not acknowledged within the publish timeout; their keys wait and are retried beside the other keys",
			"timed_out", o.timedOut, "publish_timeout", r.cfg.PublishTimeout, "topics", o.timedOutTopics)
	}
	if len(failed) > o.timedOut+o.held {
		r.log.Warn("relay: events failed; their keys wait and retry", "failed", len(failed)-o.timedOut-o.held, "first_error", o.firstErr)
	}
}

// outcome is what a publish attempt did to its events.
type outcome struct {
	acked          []int64
	dead           []deadEvent
	failed         []failedEvent
	failedKeys     map[string]bool
	oldest         time.Time // creation time of the oldest acknowledged event
	timedOut       int       // failed events not acknowledged within PublishTimeout
	held           int       // failed events not sent: their partition is sick
	sickPartitions int       // partitions marked sick once judged
	timedOutTopics []string
	firstErr       string // of the first failure that is not a timeout
	// deadKeys are the keys of the events in dead; heldKeys those of
	// events left pending untouched (in failedKeys too, not in failed).
	deadKeys, heldKeys map[string]bool
}

// judge sorts a publish attempt's events (in id order) by their errors:
// acknowledged, refused for good (dead-lettered), or failed and retried
// later; it holds back the keys of failed events. pubCtx is the context the
// attempt was published with: if its deadline passed, a passing error is a
// timeout, and the key is retried on the side (beside the rounds). losses
// is the leases' count when the events were read (leases.held).
func (r *Relay) judge(ctx, pubCtx context.Context, losses uint64, events []pendingEvent, records []Record, errs []error) outcome {
	o := outcome{failedKeys: map[string]bool{}}
	deadline := pubCtx.Err() != nil && ctx.Err() == nil
	// Cut short because its shards may be another relay's now: what failed
	// stays pending, untouched, for their owner (see boundByLeases).
	leaseLost := errors.Is(context.Cause(pubCtx), errLeaseLost)
	for i := range events {
		e := &events[i]
		err := errs[i]
		if err == nil && (len(o.failedKeys) == 0 || !o.failedKeys[blockKey(e)]) {
			o.acked = append(o.acked, e.id)
			if o.oldest.IsZero() || e.createdAt.Before(o.oldest) {
				o.oldest = e.createdAt
			}
			if r.sickCount > 0 {
				r.healthy(e)
			}
			continue
		}
		bk := blockKey(e)
		if err != nil && leaseLost {
			o.leavePending(bk)
			continue
		}
		if err != nil && (o.deadKeys[bk] && !r.refusedForGood(e, err) || errors.Is(err, ErrNotSent) && (!o.failedKeys[bk] || o.heldKeys[bk])) {
			// An earlier event of this key is dead-lettered in this
			// call. This one must not go out (alone, below) before
			// that is recorded: had the dead letter failed, the
			// earlier event would still be pending and, accepted
			// later (a topic's limit raised, say), published after
			// it (G3). (Acknowledged in this very call, it is out
			// already; refused for good without a doubt, it is
			// dead-lettered beside the earlier one.) Or the
			// publisher did not send it behind its key's earlier
			// record, which went out. Either way it stays pending,
			// untouched and unblocked, for a later round (one after
			// the dead letter is recorded: the round waits for it).
			o.leavePending(bk)
			continue
		}
		if err == nil {
			// The publisher acknowledged a later event of a key whose
			// earlier event failed in the same call. It is not taken
			// as published: it stays pending and goes out again after
			// the failed one (a duplicate, not a reordering of first
			// publications).
			r.log.Warn("relay: publisher acknowledged an event after an earlier event of its key failed; it is published again after that one",
				"event_id", string(e.eventID), "topic", e.topic)
			err = errHeldBack
		}
		kind := classify(err)
		if o.failedKeys[bk] && (kind == tooLarge || kind == invalid || kind == topicInvalid ||
			(kind == unknownTopic || kind == forbidden) && r.graceOver(e, kind)) {
			// An earlier event of this key failed: nothing of the key
			// may go out, or be dead-lettered, past it.
			err, kind = errHeldBack, retriable
		}
		if (kind == tooLarge || kind == invalid) && len(events) > 1 && !r.leases.stillHeld(losses) {
			// Its shard may be another relay's now (see round): neither
			// published alone nor dead-lettered on the batch's answer,
			// it stays pending, untouched, for the shard's owner.
			o.leavePending(bk)
			continue
		}
		if (kind == tooLarge || kind == invalid) && len(events) > 1 {
			// The broker may have refused a whole batch for one record:
			// publish this one alone to know whether it is the offender.
			timed, cancelTimed := context.WithTimeout(ctx, r.cfg.PublishTimeout)
			alone, cancel := r.boundByLeases(timed, losses)
			err = r.pub.Publish(alone, records[i:i+1])[0]
			lost := errors.Is(context.Cause(alone), errLeaseLost)
			cancel()
			cancelTimed()
			if err != nil && lost {
				o.leavePending(bk)
				continue
			}
			kind = classify(err)
		}
		switch {
		case err == nil:
			o.acked = append(o.acked, e.id)
			if o.oldest.IsZero() || e.createdAt.Before(o.oldest) {
				o.oldest = e.createdAt
			}
			if r.sickCount > 0 {
				r.healthy(e)
			}
		case kind == tooLarge || kind == topicInvalid || kind == invalid:
			o.dead = append(o.dead, deadEvent{id: e.id, err: err.Error()})
			o.noteDead(bk)
			r.log.Warn("relay: Kafka refused an event for good; dead-lettered", "event_id", string(e.eventID), "topic", e.topic, "error", err)
		case (kind == unknownTopic || kind == forbidden) && r.graceOver(e, kind):
			what, grace := "unknown", r.cfg.UnknownTopicGrace
			if kind == forbidden {
				what, grace = "forbidden", r.cfg.TopicForbiddenGrace
			}
			o.dead = append(o.dead, deadEvent{id: e.id, err: fmt.Sprintf("%v (still %s after %s)", err, what, grace)})
			o.noteDead(bk)
			r.log.Warn("relay: topic still "+what+" after its grace; dead-lettered", "event_id", string(e.eventID), "topic", e.topic, "grace", grace)
		default:
			if ctx.Err() != nil {
				// Shutting down: the event stays pending as it was, and
				// so do its key's later events.
				o.failedKeys[bk] = true
				continue
			}
			notSent := isPartitionError(err)
			timedOut := deadline && kind == retriable && !errors.Is(err, errHeldBack) && !errors.Is(err, ErrNotSent) && !notSent
			msg := err.Error()
			if notSent {
				o.held++
			} else if timedOut {
				msg = fmt.Sprintf("not acknowledged within the publish timeout (%s): %v", r.cfg.PublishTimeout, err)
				o.timedOut++
				if !slices.Contains(o.timedOutTopics, e.topic) {
					o.timedOutTopics = append(o.timedOutTopics, e.topic)
				}
			} else if o.firstErr == "" {
				o.firstErr = msg
			}
			run := runReset
			switch {
			case errors.Is(err, errHeldBack), errors.Is(err, ErrNotSent), notSent:
				run = runKeep
			case kind == unknownTopic:
				run = runUnknownTopic
			case kind == forbidden:
				run = runForbidden
			}
			// Only the key's first failed event is retried (alone, the
			// key held back behind it), and only the first pending
			// events' attempts are looked at: a later one is not charged
			// (its row is left as it is but for a refusal run to end),
			// which spares rewriting a round of rows when a key gets
			// stuck. A refusal is charged on every event: its grace
			// counts per row.
			first := !o.failedKeys[bk]
			o.failed = append(o.failed, failedEvent{id: e.id, err: msg, run: run, charge: first || run > 0, inRun: e.refusedFor != nil})
			if first {
				o.failedKeys[bk] = true
				// A record sent and not acknowledged (in time, or with
				// a passing error) marks its partition sick: the key is
				// then retried beside the rounds, as its probe.
				sick := notSent
				if kind == retriable && !notSent && !errors.Is(err, errHeldBack) && !errors.Is(err, ErrNotSent) {
					sick = r.markSick(e, bk, err)
				}
				r.block(bk, e, timedOut || sick, sick && r.isProbe(e, bk))
			}
		}
	}
	o.sickPartitions = r.sickCount
	return o
}

// leavePending leaves an event pending, untouched and its key not held
// back, for a later round: nothing of its key goes out in this one.
func (o *outcome) leavePending(bk string) {
	o.failedKeys[bk] = true
	if o.heldKeys == nil {
		o.heldKeys = map[string]bool{}
	}
	o.heldKeys[bk] = true
}

func (o *outcome) noteDead(bk string) {
	if o.deadKeys == nil {
		o.deadKeys = map[string]bool{}
	}
	o.deadKeys[bk] = true
}

// refusedForGood reports whether err refuses event e for good without
// publishing it again: an invalid topic name, or a topic unknown or
// forbidden past its grace. (A record refused for its size or content is
// published alone first to be sure.)
func (r *Relay) refusedForGood(e *pendingEvent, err error) bool {
	switch kind := classify(err); kind {
	case topicInvalid:
		return true
	case unknownTopic, forbidden:
		return r.graceOver(e, kind)
	}
	return false
}

// graceOver reports whether event e's topic has given the refusal kind
// (unknown or forbidden) without a break for longer than its grace: the run
// the outbox row records must be of the same kind.
func (r *Relay) graceOver(e *pendingEvent, kind refusal) bool {
	run, grace := runUnknownTopic, r.cfg.UnknownTopicGrace
	if kind == forbidden {
		run, grace = runForbidden, r.cfg.TopicForbiddenGrace
	}
	return e.refusedFor != nil && e.refusedKind != nil && refusalRun(*e.refusedKind) == run &&
		*e.refusedFor >= grace.Seconds()
}

// forgetRound drops the in-flight record of a round read but not sent.
func (r *Relay) forgetRound(ctx context.Context, round roundKey) {
	if _, err := r.pool.Exec(context.WithoutCancel(ctx), r.st.landedSQL, r.cfg.InstanceID, round.lo, round.hi); err != nil {
		r.log.Warn("relay: forget an unsent round", "error", err)
		r.noteDBError(err)
	}
}

// waitFinish waits until the previous round's outcome is recorded.
func (r *Relay) waitFinish() {
	if r.finishing != nil {
		<-r.finishing
		r.finishing, r.finishingIDs, r.finishingFailed = nil, nil, nil
	}
}

// finished reports whether the last round's outcome has been recorded (or
// failed to be), so that reads need not leave its events out: if its
// deletes failed, those events are pending and must be read again, also
// when no other round comes along to clear finishingIDs.
func (r *Relay) finished() bool {
	if r.finishing == nil {
		return true
	}
	select {
	case <-r.finishing:
		return true
	default:
		return false
	}
}

// finishingHeld reports whether every key that failed in the round whose
// outcome is being recorded is held back at now (its retry not due), so
// that a read at now cannot meet the rows that outcome is still writing.
func (r *Relay) finishingHeld(now time.Time) bool {
	for bk := range r.finishingFailed {
		if k := r.blocked[bk]; k == nil || !now.Before(k.retryAt) {
			return false
		}
	}
	return true
}

// readAheadWaits reports whether a read ahead should wait for the last
// round's outcome to land rather than leave that round's events out. A
// relay that owns some of the shards mostly reads them as index ranges
// merged in id order (claimShardsQuery, claimFreeQuery), which fetch every
// left-out row of their shards (a heap page each) before dropping it: 0.7
// ms a claim per 1,000 left out, with 64 shards. Beside the round with
// Kafka, the one being recorded doubled that. Its record, deletes (and any
// dead letters), takes 1-2 ms while this round is with Kafka anyway: four
// relays drained 7-12% faster waiting for it (12% in five alternating
// rounds), at 6-13% less CPU per event. A record that writes failures (it
// took 10-40 ms when it rewrote a round of a stuck key's rows; now one row
// a key, but a round's held keys still wait) is not waited for here,
// only, as before, when one of its keys is due (finishingHeld). The relay
// that owns every shard reads the rounds in flight as runs of ids it steps
// over, and does not wait; a relay owning all but a few shards reads that
// way too (claimFloorQuery), and the wait costs it only the delete's time.
func (r *Relay) readAheadWaits(shards []int16) bool {
	return len(shards) < NumShards && len(r.finishingFailed) == 0
}

// raiseCeiling stops, instead of holding e's key (Config.MaxHeldKeys is
// reached), the reading of e's partition at e: the key's later events are
// in the same partition, above e, so none goes out before it, and the
// other partitions go on (a sick partition with more keys than the cap
// costs only itself). A keyless event has no order to keep: see
// waitKeyless.
func (r *Relay) raiseCeiling(e *pendingEvent) {
	if e.key == nil {
		r.waitKeyless(e)
		return
	}
	first := r.ceilingAll == 0 && len(r.ceilings) == 0
	// e is the first event its ceiling stops: its key's events on other
	// partitions and topics wait too (belowCeiling).
	r.skippedKeys[blockKey(e)] = true
	if tp, ok := r.partitionOf(e); ok {
		if c, found := r.ceilings[tp]; !found || e.id < c {
			r.ceilings[tp] = e.id
		}
	} else if r.ceilingAll == 0 || e.id < r.ceilingAll {
		r.ceilingAll = e.id
	}
	if first {
		r.log.Warn("relay: too many keys held back; a partition's events past its first key not held are not read until the held keys are down to half",
			"held_keys", len(r.blocked), "max_held_keys", r.cfg.MaxHeldKeys, "topic", e.topic, "ceiling_id", e.id)
	}
}

// keylessWait is what waitKeyless keeps of a topic: the keyless events
// reads leave out by id, and from, where there was no room for more ids:
// the topic's keyless events from there are dropped after each read.
type keylessWait struct {
	ids  []int64
	from int64
}

// waitKeyless makes a keyless event that failed with the held keys at their
// cap wait while its topic has a sick partition. Such a topic's keyless
// events are not sent (holdSick): read again, one fails again at once,
// round after round, each charging it an attempt (in one run in two some
// 600 rounds a second). It is left out of reads by id, as an event past a
// ceiling is (the two share maxSkipped), and past that the topic's keyless
// events from it on are dropped after each read (belowCeiling), until the
// topic has no sick partition (releaseKeyless) or the ceilings lift. A
// keyless event of a healthy topic is read again: it was sent, and fails
// no faster than its publish does.
func (r *Relay) waitKeyless(e *pendingEvent) {
	if len(r.sick[e.topic]) == 0 {
		return
	}
	w := r.keylessWaits[e.topic]
	if w == nil {
		w = &keylessWait{}
		r.keylessWaits[e.topic] = w
		r.log.Warn("relay: too many keys held back; a topic's keyless events wait until it has no sick partition or the held keys are down to half",
			"held_keys", len(r.blocked), "max_held_keys", r.cfg.MaxHeldKeys, "topic", e.topic)
	}
	if len(r.skipped)+r.keylessIDs < maxSkipped {
		w.ids = append(w.ids, e.id)
		r.keylessIDs++
	} else if w.from == 0 || e.id < w.from {
		w.from = e.id
	}
}

// releaseKeyless lets the keyless events of each topic that has no sick
// partition any more be read again (waitKeyless).
func (r *Relay) releaseKeyless() {
	for topic, w := range r.keylessWaits {
		if len(r.sick[topic]) == 0 {
			r.keylessIDs -= len(w.ids)
			delete(r.keylessWaits, topic)
			r.log.Info("relay: a topic has no sick partition; its keyless events are read on", "topic", topic)
		}
	}
}

// belowCeiling drops, while a ceiling stands (see raiseCeiling), the events
// at or above their partition's that are not a held key's, notes their
// keys in r.skippedKeys, and their ids in r.skipped while there is room;
// and the keyless events a topic's wait drops (waitKeyless). Held keys'
// events are governed by their own hold.
func (r *Relay) belowCeiling(events []pendingEvent) []pendingEvent {
	if r.ceilingAll == 0 && len(r.ceilings) == 0 && len(r.keylessWaits) == 0 {
		return events
	}
	out := events[:0:0]
	for i := range events {
		e := &events[i]
		if w := r.keylessWaits[e.topic]; w != nil && e.key == nil && w.from != 0 && e.id >= w.from {
			continue
		}
		if bk := blockKey(e); r.blocked[bk] == nil && e.key != nil {
			above := r.ceilingAll != 0 && e.id >= r.ceilingAll || r.skippedKeys[bk]
			if !above && len(r.ceilings) > 0 {
				if tp, ok := r.partitionOf(e); ok {
					c, found := r.ceilings[tp]
					above = found && e.id >= c
				}
			}
			if above {
				// The key is noted even with no room left for the id:
				// it is what stops the key's events on other
				// partitions, and other topics, until the ceilings lift.
				r.skippedKeys[bk] = true
				if len(r.skipped)+r.keylessIDs < maxSkipped {
					r.skipped = append(r.skipped, e.id)
				}
				continue
			}
		}
		out = append(out, *e)
	}
	return out
}

// liftCeiling lifts the ceilings once the held keys are down to half of
// Config.MaxHeldKeys: the events above them are read again, each key's from
// its first pending one (the failed one). It reports whether reads left out
// events the ceilings stopped (r.skipped) until now: a read made before
// (a read-ahead) may hold their keys' later events, read past them.
func (r *Relay) liftCeiling() (skipped bool) {
	if (r.ceilingAll != 0 || len(r.ceilings) > 0 || len(r.keylessWaits) > 0) && len(r.blocked) <= r.cfg.MaxHeldKeys/2 {
		r.log.Info("relay: held keys are down to half their cap; reading on", "held_keys", len(r.blocked), "partitions", len(r.ceilings), "keyless_topics", len(r.keylessWaits))
		skipped = len(r.skipped) > 0 // keyless events have no order a read ahead could break
		r.ceilingAll = 0
		clear(r.ceilings)
		r.skipped = r.skipped[:0]
		clear(r.skippedKeys)
		clear(r.keylessWaits)
		r.keylessIDs = 0
	}
	return skipped
}

// withSkipped returns excluded plus the events a ceiling stopped
// (r.skipped) and the keyless events that wait (waitKeyless), for a read.
func (r *Relay) withSkipped(excluded []int64) []int64 {
	if len(r.skipped) == 0 && r.keylessIDs == 0 {
		return excluded
	}
	out := append(slices.Clip(excluded), r.skipped...)
	for _, w := range r.keylessWaits {
		out = append(out, w.ids...)
	}
	return out
}

// withoutBlocked drops prefetched events whose key is waiting out a retry;
// they stay pending and are read again once the key may go.
func (r *Relay) withoutBlocked(events []pendingEvent, now time.Time) []pendingEvent {
	if len(r.blocked) == 0 {
		return events
	}
	var buf []byte
	var out []pendingEvent // a copy only once an event is dropped
	for i := range events {
		buf = appendBlockKey(buf[:0], &events[i])
		k := r.blocked[string(buf)]
		if k != nil && now.Before(k.retryAt) && events[i].id >= k.firstID {
			if out == nil {
				out = append(make([]pendingEvent, 0, len(events)-1), events[:i]...)
			}
			continue
		}
		if out != nil {
			out = append(out, events[i])
		}
	}
	if out == nil {
		return events
	}
	return out
}

// oneTopicPerKey drops from a round, for each key whose events in it span
// several topics, the first event on another topic than the key's first
// one and every later event of the key. Records of one key on one topic go
// to one partition, where the publisher keeps them in order and stops at the
// first failure; across topics nothing would stop a later event from being
// acknowledged while an earlier one fails. The dropped events stay pending
// for a later round, once the earlier ones are acknowledged.
func oneTopicPerKey(events []pendingEvent) []pendingEvent {
	mixed := false
	for i := 1; i < len(events) && !mixed; i++ {
		mixed = events[i].topic != events[0].topic
	}
	if !mixed {
		return events
	}
	topicOf := map[string]string{}
	cut := map[string]bool{}
	out := events[:0:0]
	for i := range events {
		e := &events[i]
		if e.key == nil { // a keyless event is its own unit of order
			out = append(out, *e)
			continue
		}
		k := string(e.key)
		if cut[k] {
			continue
		}
		if t, ok := topicOf[k]; ok && t != e.topic {
			cut[k] = true
			continue
		}
		topicOf[k] = e.topic
		out = append(out, *e)
	}
	return out
}

func toRecord(e *pendingEvent) Record {
	return toRecordIn(e, nil)
}

// toRecordIn is toRecord taking an event without headers of its own (the
// common case) its message-id header from one[0] (a round's share of one
// allocation), not a slice allocated per event.
func toRecordIn(e *pendingEvent, one []Header) Record {
	rec := Record{Topic: e.topic, Key: e.key, Value: e.value}
	if len(e.headers) == 0 && len(one) > 0 {
		one[0] = Header{Key: MessageIDHeader, Value: e.eventID}
		rec.Headers = one[:1:1]
		return rec
	}
	rec.Headers = make([]Header, 0, len(e.headers)+1)
	rec.Headers = append(rec.Headers, Header{Key: MessageIDHeader, Value: e.eventID})
	names := make([]string, 0, len(e.headers))
	for k := range e.headers {
		if k != MessageIDHeader { // the event id wins: G4
			names = append(names, k)
		}
	}
	sort.Strings(names)
	for _, k := range names {
		rec.Headers = append(rec.Headers, Header{Key: k, Value: []byte(e.headers[k])})
	}
	return rec
}

func blockKey(e *pendingEvent) string {
	return string(appendBlockKey(nil, e))
}

// appendBlockKey appends e's blockKey to buf. A map lookup by
// string(appendBlockKey(buf[:0], e)) does not allocate, where blockKey
// does: the round's checks run it for every event of every round while a
// key is held (a string a time, a tenth of a millisecond a round).
func appendBlockKey(buf []byte, e *pendingEvent) []byte {
	if e.key == nil {
		return strconv.AppendInt(append(buf, "\x00id:"...), e.id, 10)
	}
	return append(append(buf, "k:"...), e.key...)
}

// stopGrace is how long a stopped relay waits for the acknowledgements of
// the round it has with Kafka (at most PublishTimeout).
const stopGrace = 5 * time.Second

// publishContext returns the context a publish of events read under ctx
// runs in, and the function that releases it: PublishTimeout, and once ctx
// is done (a stop) up to stopGrace more, so that what Kafka acknowledges
// meanwhile is recorded and a rolling restart publishes nothing twice; past
// that the publish is abandoned and its events stay pending for the next
// owner. A relay whose instance id another process took stops at once, and
// so does one whose leases of the events' shards stop holding (losses, see
// boundByLeases).
func (r *Relay) publishContext(ctx context.Context, losses uint64) (context.Context, func()) {
	timed, cancelTimed := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.PublishTimeout)
	pubCtx, cancelBound := r.boundByLeases(timed, losses)
	cancelPub := func() { cancelBound(); cancelTimed() }
	stopWatch := context.AfterFunc(ctx, func() {
		var inUse *InstanceInUseError
		if errors.As(context.Cause(ctx), &inUse) {
			cancelPub() // another process has this relay's id
			return
		}
		t := time.NewTimer(stopGrace)
		defer t.Stop()
		select {
		case <-t.C:
			cancelPub()
		case <-pubCtx.Done():
		}
	})
	return pubCtx, func() { stopWatch(); cancelPub() }
}

// errLeaseLost ends a publish whose events' shards may be another relay's.
var errLeaseLost = errors.New("relay: the shard leases lapsed while the events were with Kafka")

// boundByLeases returns parent, ended (with cause errLeaseLost) once the
// shards of a snapshot taken under losses are no longer held. A publish
// must not outlive the leases it was read under: the shards' new owner may
// settle its events meanwhile, dead-letter a key's first event and publish
// the next, say, and the first, accepted by a still-retrying client (the
// topic's limit raised), would then go out after it (G3). What a client
// has sent already may still land: the window shrinks to a round trip.
func (r *Relay) boundByLeases(parent context.Context, losses uint64) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(parent)
	go r.leases.untilLost(losses, ctx.Done(), func() { cancel(errLeaseLost) })
	return ctx, func() { cancel(nil) }
}

// errHeldBack fails an event not published because an earlier event of its
// key failed in the same round.
var errHeldBack = errors.New("held back: an earlier event of its key failed")

// block holds back the key of failed event e until its backoff passes,
// counted from now (not from the round's start, which may be long ago).
// A key whose event timed out is held back from the rounds until the side retry
// has published that event (see sideretry.go).
//
// A key not held yet, once Config.MaxHeldKeys keys are, is not held:
// instead nothing at or above its event is read until the ceiling lifts
// (but a sick partition's probe, which the partition needs to heal).
func (r *Relay) block(bk string, e *pendingEvent, timedOut, probe bool) {
	now := time.Now()
	k := r.blocked[bk]
	if k == nil && len(r.blocked) >= r.cfg.MaxHeldKeys && !probe {
		r.raiseCeiling(e)
		return
	}
	if k == nil {
		k = &keyState{key: e.key, keyless: e.key == nil, backoff: newBackoff(r.cfg.MaxRetryBackoff)}
		r.blocked[bk] = k
	}
	k.firstID = e.id
	k.lastSeen = now
	k.part, k.hasPart = r.partitionOf(e)
	k.timedOut, k.onSide = timedOut, false
	if timedOut {
		k.retryAt = farFuture
		k.sideAt = now.Add(k.backoff.NextBackOff())
	} else {
		k.retryAt = now.Add(k.backoff.NextBackOff())
	}
}

// exclusions lists what must not be read now: for each key waiting out its
// backoff, its failed event and every later one; for each key whose
// backoff has passed, every event after its failed one, so that the retry
// reads the failed event alone (a key stuck with 300,000 events retries
// one, not a round of them), and the key's later events follow once it is
// acknowledged.
func (r *Relay) exclusions(now time.Time) (keys []keyBlock, ids []int64) {
	for _, k := range r.blocked {
		due := !now.Before(k.retryAt)
		switch {
		case k.keyless && !due:
			ids = append(ids, k.firstID)
		case k.keyless:
		case !due:
			keys = append(keys, keyBlock{key: k.key, firstID: k.firstID})
		default:
			keys = append(keys, keyBlock{key: k.key, firstID: k.firstID + 1})
		}
	}
	return keys, ids
}

// forgetLostRetries drops the hold on each key whose backoff has passed
// (its retry reads only its failed event, see exclusions) when a claim of
// events did not bring that event back and it is not in flight (inFlight):
// published by another relay after its shard moved, not this relay's shard
// any more, or beyond the round's size. The next claim reads the key from
// its oldest pending event, as for any key. Keyless events' holds too:
// kept, a hold on an event another relay published counted towards
// MaxHeldKeys for good, and a ceiling raised over the cap never lifted.
func (r *Relay) forgetLostRetries(now time.Time, events []pendingEvent, inFlight []int64) {
	var found map[string]bool
	for bk, k := range r.blocked {
		if now.Before(k.retryAt) {
			continue
		}
		if found == nil {
			found = make(map[string]bool, len(events))
			for i := range events {
				found[blockKey(&events[i])] = true
			}
		}
		if !found[bk] && !slices.Contains(inFlight, k.firstID) {
			delete(r.blocked, bk)
		}
	}
}

// forgetStaleBlocks drops keys not seen for a while (their events were
// published by another relay after a shard moved).
func (r *Relay) forgetStaleBlocks(now time.Time) {
	for bk, k := range r.blocked {
		if now.Sub(k.retryAt) > time.Minute && now.Sub(k.lastSeen) > time.Minute {
			delete(r.blocked, bk)
		}
	}
}

func newBackoff(maxInterval time.Duration) backoff.BackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = 100 * time.Millisecond
	b.MaxInterval = maxInterval
	b.MaxElapsedTime = 0 // never give up: broker outages are waited out
	b.Reset()
	return b
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
