// Package e2e_test runs onceflow the way it runs in production and checks
// the guarantees from the data: writers commit business rows and events
// together, two `onceflow relay` processes publish them, two
// `examples/ledger` workers apply them, and meanwhile processes are
// SIGKILLed, the broker fails requests and the database drops connections.
//
//	go test ./internal/e2e                        # skipped with -short
//	ONCEFLOW_TEST_SEED=123 go test ./internal/e2e # replay a run's plan
package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/internal/proctest"
	"github.com/onceflow/onceflow/outbox"
)

const (
	writers           = 4
	accountsPerWriter = 25  // each account is written by one writer only, so its order is known
	txPerWriter       = 150 // every tenth rolls back
	eventsPerTx       = 20  // committed: 4 × 135 × 20 = 10,800 events
	partitions        = 8
	group             = "ledger-e2e"

	// The ledger has no flag for group timeouts and franz-go asks for a 45s
	// session and a 60s rebalance, which would leave a SIGKILLed worker's
	// partitions idle for most of the test; the broker caps them instead.
	// The session must outlast the rebalance: kfake expires a member
	// waiting in JoinGroup when its session runs out and never answers its
	// join, which wedges the group until franz-go's request timeout (~70s).
	sessionTimeout   = 8 * time.Second
	rebalanceTimeout = 5 * time.Second
)

// event is what a writer wrote, as the checks need it.
type event struct {
	account string
	seq     int // position among the account's committed events
	cents   int64
}

// action is one step of the chaos plan.
type action int

const (
	killRelay action = iota
	killLedger
	produceFault
	fetchFault
	commitFault
	dropRelayConns
	dropLedgerConns
	killBroker
)

func (a action) String() string {
	return [...]string{"SIGKILL relay", "SIGKILL ledger", "produce fault", "fetch fault",
		"offset-commit fault", "terminate relay connections", "terminate ledger connections", "SIGKILL broker"}[a]
}

var errRollback = errors.New("e2e: roll back on purpose")

// TestEndToEndCrashesAndFaults checks, after a run full of crashes and faults:
//   - G1: rolled-back transactions left no event anywhere; committed ones
//     left their business row and their event.
//   - G2: every committed event is in the topic.
//   - G3: per account, first occurrences in the topic follow write order.
//   - G4: every record carries the message-id of the event it holds.
//   - G5: every balance equals the sum written for the account, and
//     processed_messages holds exactly one row per event.
//   - the group's committed offsets equal the partitions' end offsets, and
//     nothing was dead-lettered.
func TestEndToEndCrashesAndFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("end-to-end test builds and kills processes; skipped with -short")
	}
	plan := []action{killRelay, killRelay, killRelay, killLedger, killLedger, killLedger,
		dropRelayConns, dropRelayConns, dropLedgerConns, dropLedgerConns}
	if kafkatest.Real() {
		t.Log("real broker: the plan leaves out produce, fetch and offset-commit faults, which need kfake's fault injection " +
			"(make test runs them on kfake); TestEndToEndBrokerKilled SIGKILLs a real broker instead")
		runEndToEnd(t, scenario{k: kafkatest.New(t), plan: plan, shuffle: true})
		return
	}
	brokerLog := &proctest.Buffer{}
	k := kafkatest.New(t, kfake.WithLogger(kfake.BasicLogger(brokerLog, kfake.LogLevelWarn)))
	capGroupTimeouts(k.Fake)
	plan = append(plan, produceFault, produceFault, fetchFault, commitFault)
	runEndToEnd(t, scenario{k: k, brokerLog: brokerLog, plan: plan, shuffle: true})
}

// TestEndToEndBrokerKilled is the same run against a real Apache Kafka
// broker of the test's own, which is SIGKILLed twice mid-stream and
// restarted while relays publish and ledgers consume: nothing is lost,
// nothing dead-lettered, G3 holds and every balance is exact. It needs the
// broker of scripts/kafka.sh (make test-kafka); kfake runs inside the test
// process and cannot be killed.
func TestEndToEndBrokerKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("end-to-end test builds and kills processes; skipped with -short")
	}
	b := kafkatest.NewBroker(t)
	runEndToEnd(t, scenario{k: &b.Kafka, broker: b,
		plan: []action{killBroker, killRelay, killLedger, dropRelayConns, killBroker, killLedger, killRelay, dropLedgerConns}})
}

// scenario is one end-to-end run: the Kafka it uses and its chaos plan.
type scenario struct {
	k         *kafkatest.Kafka
	broker    *kafkatest.Broker // for killBroker; nil otherwise
	brokerLog *proctest.Buffer  // kfake's warnings; nil on a real broker
	plan      []action
	shuffle   bool // draw the plan's order from the seed
}

func runEndToEnd(t *testing.T, sc scenario) {
	start := time.Now()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("ONCEFLOW_TEST_SEED"); s != "" {
		if _, err := fmt.Sscan(s, &seed); err != nil {
			t.Fatalf("ONCEFLOW_TEST_SEED=%q: %v", s, err)
		}
	}
	t.Logf("seed %d (set ONCEFLOW_TEST_SEED=%d to replay the plan)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, 0))

	bins := buildBinaries(t)
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.Schema(t)
	k, fake := sc.k, sc.k.Fake
	topic := k.Topic(t, partitions)
	k.CreateTopic(t, topic+".dlq", 1, nil)
	adm := k.Admin(t)
	t.Cleanup(func() {
		if t.Failed() {
			if sc.brokerLog != nil {
				t.Logf("broker warnings:\n%s", tail(sc.brokerLog.String(), 20000))
			}
			t.Logf("group:\n%s", describeGroup(adm))
		}
	})

	payments := pgx.Identifier{schema, "e2e_payments"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+payments+` (
		event_id uuid PRIMARY KEY, account text NOT NULL, amount_cents bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}

	// Each kind of child gets its own application_name, so the test can
	// terminate exactly its connections and no one else's.
	relayApp, ledgerApp := "e2e-relay-"+schema, "e2e-ledger-"+schema
	relays := make([]*role, 2)
	for i := range relays {
		relays[i] = &role{
			name: fmt.Sprintf("relay %d", i+1), bin: bins.onceflow, ready: "relay started",
			args: []string{"relay", "--lease-duration", "1s", "--poll-interval", "100ms", "--batch-size", "500", "--log-level", "info"},
			env: []string{
				"ONCEFLOW_DATABASE_URL=" + withParams(t, pgtest.URL(t), "application_name", relayApp),
				"ONCEFLOW_SCHEMA=" + schema,
				"ONCEFLOW_BROKERS=" + strings.Join(k.Brokers, ","),
			},
		}
	}
	ledgers := make([]*role, 2)
	for i := range ledgers {
		ledgers[i] = &role{
			name: fmt.Sprintf("ledger %d", i+1), bin: bins.ledger, ready: "ledger: consuming",
			args: []string{"--database-url", withParams(t, pgtest.URL(t), "application_name", ledgerApp, "search_path", schema),
				"--brokers", strings.Join(k.Brokers, ","), "--topic", topic, "--group", group, "--schema", schema,
				"--session-timeout", sessionTimeout.String(), "--rebalance-timeout", rebalanceTimeout.String()},
		}
	}
	all := append(append([]*role{}, relays...), ledgers...)
	for _, r := range all {
		r.start(t)
		t.Cleanup(func() { r.cleanup(t) })
	}
	// A process that exits by itself (a relay or worker giving up on a
	// database or broker error) is a failure; it is restarted so the run
	// can still check the data.
	checkAlive := func() {
		t.Helper()
		for _, r := range all {
			if err, ok := r.exitedOnItsOwn(); ok {
				t.Errorf("%s exited on its own (%v); restarting it", r.name, err)
				r.start(t)
			}
		}
	}

	// Writers: business row and event in one transaction.
	writer, err := outbox.NewWriter(&outbox.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu         sync.Mutex
		committed  = map[string]event{}
		rolledBack = map[string]bool{}
		wg         sync.WaitGroup
		writeErrs  = make(chan error, writers)
	)
	for w := range writers {
		wrng := rand.New(rand.NewPCG(seed, uint64(w)+1))
		wg.Add(1)
		go func() {
			defer wg.Done()
			seqs := make([]int, accountsPerWriter)
			for tx := range txPerWriter {
				rollback := tx%10 == 9
				msgs := make([]outbox.Message, eventsPerTx)
				evs := make([]event, eventsPerTx)
				ids, accounts, cents := make([]string, eventsPerTx), make([]string, eventsPerTx), make([]int64, eventsPerTx)
				next := append([]int(nil), seqs...)
				for i := range msgs {
					a := wrng.IntN(accountsPerWriter)
					ev := event{account: fmt.Sprintf("w%d-a%02d", w, a), seq: next[a], cents: int64(1 + wrng.IntN(100_000))}
					next[a]++
					ids[i], accounts[i], cents[i], evs[i] = outbox.NewID(), ev.account, ev.cents, ev
					msgs[i] = outbox.Message{ID: ids[i], Topic: topic, Key: []byte(ev.account), Value: paymentJSON(ev)}
				}
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, `INSERT INTO `+payments+` (event_id, account, amount_cents)
						SELECT * FROM unnest($1::uuid[], $2::text[], $3::bigint[])`, ids, accounts, cents); err != nil {
						return err
					}
					if err := writer.Write(ctx, tx, msgs...); err != nil {
						return err
					}
					if rollback {
						return errRollback
					}
					return nil
				})
				switch {
				case rollback && errors.Is(err, errRollback):
					mu.Lock()
					for _, id := range ids {
						rolledBack[id] = true
					}
					mu.Unlock()
				case err != nil:
					writeErrs <- fmt.Errorf("writer %d, transaction %d: %w", w, tx, err)
					return
				default:
					seqs = next
					mu.Lock()
					for i, id := range ids {
						committed[id] = evs[i]
					}
					mu.Unlock()
				}
				time.Sleep(time.Duration(40+wrng.IntN(80)) * time.Millisecond) // pacing, so events arrive throughout the chaos
			}
		}()
	}

	// The chaos plan: every kind of fault, in an order and at moments
	// drawn from the seed, while the writers write.
	plan := append([]action(nil), sc.plan...)
	if sc.shuffle {
		rng.Shuffle(len(plan), func(i, j int) { plan[i], plan[j] = plan[j], plan[i] })
	}
	var faults []*kfake.FaultHandle
	terminated := 0
	for _, a := range plan {
		pause := time.Duration(400+rng.IntN(800)) * time.Millisecond
		which := rng.IntN(2)
		n := 2 + rng.IntN(8)
		time.Sleep(pause) // the plan's random moment, not a wait for a condition
		checkAlive()
		detail := ""
		switch a {
		case killRelay:
			relays[which].kill()
			relays[which].start(t)
			detail = relays[which].name
		case killLedger:
			// Only a member of a settled group: kfake never expires a
			// member killed between sending JoinGroup and reading the
			// answer (it stops the pending timer and starts the session
			// timer only once the answer is delivered), so such a kill
			// would hold partitions for good.
			waitFor(t, "the group to settle with both ledgers", 90*time.Second, func() error {
				checkAlive()
				return groupSettled(ctx, adm, len(ledgers))
			})
			ledgers[which].kill()
			ledgers[which].start(t)
			detail = ledgers[which].name
		case killBroker:
			// SIGKILL mid-stream; the script restarts it on the same
			// ports and data, and waits until it answers.
			sc.broker.Kill(t)
			down := time.Now()
			sc.broker.Start(t)
			detail = fmt.Sprintf("down %.1fs", time.Since(down).Seconds())
		case produceFault:
			errs := []*kerr.Error{kerr.NotEnoughReplicas, kerr.NotLeaderForPartition, kerr.RequestTimedOut}
			e := errs[rng.IntN(len(errs))]
			faults = append(faults, fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: e, Count: n}))
			detail = fmt.Sprintf("%d × %v", n, e)
		case fetchFault:
			faults = append(faults, fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Fetch}, Err: kerr.NotLeaderForPartition, Count: n}))
			detail = fmt.Sprintf("%d × %v", n, kerr.NotLeaderForPartition)
		case commitFault:
			faults = append(faults, fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.OffsetCommit}, Err: kerr.CoordinatorLoadInProgress, Count: n}))
			detail = fmt.Sprintf("%d × %v", n, kerr.CoordinatorLoadInProgress)
		case dropRelayConns, dropLedgerConns:
			app, rs := relayApp, relays
			if a == dropLedgerConns {
				app, rs = ledgerApp, ledgers
			}
			// Only processes past start-up: a database that cannot be
			// reached at start is an error by design.
			for _, r := range rs {
				waitFor(t, r.name+" to be ready", 30*time.Second, func() error {
					if !r.isReady() {
						return errors.New("not ready")
					}
					return nil
				})
			}
			var killed int
			if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
				FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&killed); err != nil {
				t.Fatalf("terminate connections: %v", err)
			}
			terminated += killed
			detail = fmt.Sprintf("%d terminated", killed)
		}
		t.Logf("%6.2fs %s: %s", time.Since(start).Seconds(), a, detail)
	}

	writersDone := make(chan struct{})
	go func() { wg.Wait(); close(writersDone) }()
	select {
	case <-writersDone:
	case <-time.After(60 * time.Second):
		t.Fatal("writers did not finish within 60s")
	}
	close(writeErrs)
	for err := range writeErrs {
		t.Fatal(err)
	}
	hits := 0
	for _, f := range faults {
		hits += f.Hits()
		f.Remove()
	}
	t.Logf("%6.2fs writers done: %d events committed, %d rolled back; %d broker requests faulted, %d database connections terminated",
		time.Since(start).Seconds(), len(committed), len(rolledBack), hits, terminated)

	outboxTable := pgx.Identifier{schema, "outbox"}.Sanitize()
	processedTable := pgx.Identifier{schema, "processed_messages"}.Sanitize()
	waitFor(t, "the outbox to drain", 120*time.Second, func() error {
		checkAlive()
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+outboxTable).Scan(&n); err != nil {
			return err
		}
		if n > 0 {
			return fmt.Errorf("%d events pending", n)
		}
		return nil
	})
	t.Logf("%6.2fs outbox drained", time.Since(start).Seconds())
	waitFor(t, "the ledgers to consume everything", 120*time.Second, func() error {
		checkAlive()
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+processedTable+` WHERE consumer = $1`, group).Scan(&n); err != nil {
			return err
		}
		if n < len(committed) {
			return fmt.Errorf("%d of %d events processed", n, len(committed))
		}
		return offsetsAtEnd(ctx, adm, topic)
	}, func() {
		t.Logf("group:\n%s", describeGroup(adm))
		for _, r := range ledgers {
			r.dumpStacks()
		}
	})
	t.Logf("%6.2fs everything consumed", time.Since(start).Seconds())
	for _, r := range all {
		r.stop(t, 30*time.Second)
	}

	// G1: the business rows are exactly the committed events.
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+payments).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != len(committed) {
		t.Errorf("G1: %d business rows, %d committed events", rows, len(committed))
	}
	for _, table := range []string{"outbox", "outbox_dead"} {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, table}.Sanitize()).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Errorf("%s holds %d events after the run, want 0", table, n)
		}
	}

	// G2, G3, G4 from the topic.
	records := readTopic(t, k, adm, topic)
	firstSeen := map[string]bool{}
	nextSeq := map[string]int{}
	dups, orderErrs := 0, 0
	for _, r := range records {
		id := header(r, outbox.MessageIDHeader)
		if rolledBack[id] {
			t.Fatalf("G1: record %s/%d@%d holds event %s of a rolled-back transaction", r.Topic, r.Partition, r.Offset, id)
		}
		ev, ok := committed[id]
		if !ok {
			t.Fatalf("G4: record %d@%d has message-id %q, which is no event written", r.Partition, r.Offset, id)
		}
		if string(r.Key) != ev.account || string(r.Value) != string(paymentJSON(ev)) {
			t.Fatalf("G4: record %d@%d (message-id %s) has key %q value %s, the event is %+v", r.Partition, r.Offset, id, r.Key, r.Value, ev)
		}
		if firstSeen[id] {
			dups++
			continue
		}
		firstSeen[id] = true
		if ev.seq != nextSeq[ev.account] {
			if orderErrs++; orderErrs <= 5 {
				t.Errorf("G3: account %s: event %d first published at %d@%d when event %d was due", ev.account, ev.seq, r.Partition, r.Offset, nextSeq[ev.account])
			}
		}
		nextSeq[ev.account] = max(nextSeq[ev.account], ev.seq+1)
	}
	if len(firstSeen) != len(committed) {
		t.Errorf("G2: %d of %d committed events reached Kafka", len(firstSeen), len(committed))
	}

	// G5: balances and dedup rows.
	want := map[string]int64{}
	for _, ev := range committed {
		want[ev.account] += ev.cents
	}
	got := map[string]int64{}
	brows, err := pool.Query(ctx, `SELECT account, balance_cents FROM `+pgx.Identifier{schema, "ledger_accounts"}.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	var account string
	var cents int64
	if _, err := pgx.ForEachRow(brows, []any{&account, &cents}, func() error { got[account] = cents; return nil }); err != nil {
		t.Fatal(err)
	}
	wrong := 0
	for a, w := range want {
		if got[a] != w {
			if wrong++; wrong <= 5 {
				t.Errorf("G5: account %s balance %d, want %d (%+d)", a, got[a], w, got[a]-w)
			}
		}
	}
	if len(got) != len(want) {
		t.Errorf("G5: %d accounts in ledger_accounts, want %d", len(got), len(want))
	}
	var processed, matched int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(p.event_id) FROM `+processedTable+` m
		LEFT JOIN `+payments+` p ON p.event_id::text = m.message_id WHERE m.consumer = $1`, group).Scan(&processed, &matched); err != nil {
		t.Fatal(err)
	}
	if processed != len(committed) || matched != len(committed) {
		t.Errorf("G5: processed_messages has %d rows (%d of them committed events), want %d", processed, matched, len(committed))
	}

	// Offsets: everything committed, nothing dead-lettered.
	if err := offsetsAtEnd(ctx, adm, topic); err != nil {
		t.Errorf("after shutdown: %v", err)
	}
	dlq, err := adm.ListEndOffsets(ctx, topic+".dlq")
	if err != nil {
		t.Fatal(err)
	}
	dlq.Each(func(o kadm.ListedOffset) {
		if o.Offset != 0 {
			t.Errorf("dead-letter topic holds %d records, want none", o.Offset)
		}
	})

	kills := 0
	for _, r := range all {
		kills += len(r.past)
	}
	t.Logf("%6.2fs checked: %d events, %d records (%d re-sent), %d processes SIGKILLed and restarted",
		time.Since(start).Seconds(), len(committed), len(records), dups, kills)
}

// capGroupTimeouts makes the broker cap the session and rebalance timeouts
// a joining member asks for, as a broker's group.max.session.timeout.ms
// would, so a SIGKILLed worker's partitions move within seconds.
func capGroupTimeouts(fake *kfake.Cluster) {
	fake.ControlKey(int16(kmsg.JoinGroup), func(req kmsg.Request) (kmsg.Response, error, bool) {
		join := req.(*kmsg.JoinGroupRequest)
		join.SessionTimeoutMillis = min(join.SessionTimeoutMillis, int32(sessionTimeout.Milliseconds()))
		join.RebalanceTimeoutMillis = min(join.RebalanceTimeoutMillis, int32(rebalanceTimeout.Milliseconds()))
		return nil, nil, false // not handled: the broker goes on with the capped request
	})
}

func paymentJSON(ev event) []byte {
	return fmt.Appendf(nil, `{"account":%q,"amount_cents":%d,"seq":%d}`, ev.account, ev.cents, ev.seq)
}

// withParams returns dbURL with query parameters set (name, value pairs).
func withParams(t *testing.T, dbURL string, kv ...string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatalf("parse database URL: %v", err)
	}
	q := u.Query()
	for i := 0; i+1 < len(kv); i += 2 {
		q.Set(kv[i], kv[i+1])
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// offsetsAtEnd returns nil when the group has committed every partition's
// end offset: no record left unconsumed, no offset left behind.
func offsetsAtEnd(ctx context.Context, adm *kadm.Client, topic string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err != nil {
		return err
	}
	committed, err := adm.FetchOffsets(ctx, group)
	if err != nil {
		return err
	}
	var errs []error
	ends.Each(func(end kadm.ListedOffset) {
		if end.Err != nil {
			errs = append(errs, fmt.Errorf("partition %d: end offset: %w", end.Partition, end.Err))
			return
		}
		c, ok := committed.Lookup(end.Topic, end.Partition)
		switch {
		case !ok && end.Offset == 0:
		case !ok:
			errs = append(errs, fmt.Errorf("partition %d: nothing committed, end %d", end.Partition, end.Offset))
		case c.Err != nil:
			errs = append(errs, fmt.Errorf("partition %d: committed offset: %w", end.Partition, c.Err))
		case c.At != end.Offset:
			errs = append(errs, fmt.Errorf("partition %d: committed %d, end %d", end.Partition, c.At, end.Offset))
		}
	})
	return errors.Join(errs...)
}

// readTopic reads every partition from its start to its end offset.
func readTopic(t *testing.T, k *kafkatest.Kafka, adm *kadm.Client, topic string) []*kgo.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	want := map[int32]int64{}
	from := map[int32]kgo.Offset{}
	ends.Each(func(o kadm.ListedOffset) {
		if o.Offset > 0 {
			want[o.Partition] = o.Offset
			from[o.Partition] = kgo.NewOffset().AtStart()
		}
	})
	cl := k.Client(t, kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: from}))
	var out []*kgo.Record
	for len(want) > 0 {
		fetches := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("read %s: partitions %v not read to their end within 60s", topic, want)
		}
		fetches.EachError(func(_ string, p int32, err error) { t.Logf("fetch partition %d: %v", p, err) })
		fetches.EachRecord(func(r *kgo.Record) {
			out = append(out, r)
			if end, ok := want[r.Partition]; ok && r.Offset+1 >= end {
				delete(want, r.Partition)
			}
		})
	}
	return out
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

func tail(s string, n int) string {
	if len(s) > n {
		return "…" + s[len(s)-n:]
	}
	return s
}

// groupSettled returns nil when the group is stable with n members.
func groupSettled(ctx context.Context, adm *kadm.Client, n int) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	groups, err := adm.DescribeGroups(ctx, group)
	if err != nil {
		return err
	}
	g, ok := groups[group]
	switch {
	case !ok:
		return errors.New("group not described")
	case g.Err != nil:
		return g.Err
	case g.State != "Stable" || len(g.Members) != n:
		return fmt.Errorf("group %s with %d members", g.State, len(g.Members))
	}
	return nil
}

// describeGroup is the group's state, for the failure log.
func describeGroup(adm *kadm.Client) string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	groups, err := adm.DescribeGroups(ctx, group)
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, g := range groups.Sorted() {
		fmt.Fprintf(&b, "state %s, protocol %s, err %v\n", g.State, g.Protocol, g.Err)
		for _, m := range g.Members {
			fmt.Fprintf(&b, "  member %s host %s", m.MemberID, m.ClientHost)
			if a, ok := m.Assigned.AsConsumer(); ok {
				for _, t := range a.Topics {
					fmt.Fprintf(&b, " %v", t.Partitions)
				}
			}
			b.WriteString("\n")
		}
	}
	return b.String()
}
