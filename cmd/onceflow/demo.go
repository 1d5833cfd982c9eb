package main

import (
	"context"
	cryptorand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
)

const demoSummary = `Run the whole story on this machine: migrate a new schema of its own, start an
embedded Kafka (kfake) unless --brokers is given, write payments and their
events in one transaction from several producers, publish them with two relay
processes and apply them with two idempotent consumer processes (one of
each is SIGKILLed and restarted mid-way), inject duplicate events, then check from the data that
no event was lost, none was applied twice and per-account order held.
Exit status 1 if any check fails.

The demo reads only these flags, never ONCEFLOW_* variables. It creates a new
schema named onceflow_demo_<random> and drops only that one at the end (keep
it with --keep). Brokers not on this machine need --allow-remote-brokers.

Needs PostgreSQL only: --database-url defaults to the local server
(postgres://postgres@127.0.0.1:5432/postgres). When that default does not
answer (a --database-url given is never replaced), the demo starts an embedded
PostgreSQL (its binaries are downloaded from Maven Central on first use and
cached) and removes it at the end.`

// demoDatabaseURL is the demo's default database: the local server.
const demoDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

type demoPayment struct {
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
	Seq         int    `json:"seq"`
}

// demoConfig is what the demo runs with: its own flags only.
type demoConfig struct {
	databaseURL string
	urlGiven    bool // --database-url was given: no embedded fallback
	embedded    bool // --embedded-postgres
	brokers     []string
	schema      string // chosen by the demo, new each run
	payments    int
	accounts    int
	keep        bool
}

// parseDemoFlags reads the demo's flags. Unlike every other command it
// reads no environment variable: run in a relay's pod it must not find the
// production database, schema or brokers.
func parseDemoFlags(args []string, stderr io.Writer) (*demoConfig, error) {
	cfg := &demoConfig{}
	fs := newFlagSet("demo", demoSummary, stderr)
	fs.StringVar(&cfg.databaseURL, "database-url", demoDatabaseURL, "PostgreSQL URL the demo creates its schema in")
	brokers := fs.String("brokers", "", "Kafka brokers on this machine, comma-separated host:port; default an embedded Kafka (kfake)")
	remote := fs.Bool("allow-remote-brokers", false, "allow --brokers not on this machine (the demo creates a topic and writes to it)")
	fs.BoolVar(&cfg.embedded, "embedded-postgres", false, "use an embedded PostgreSQL even if --database-url answers")
	fs.IntVar(&cfg.payments, "payments", 20000, "payments to write")
	fs.IntVar(&cfg.accounts, "accounts", 200, "accounts (the event key: per-account order is checked)")
	fs.BoolVar(&cfg.keep, "keep", false, "keep the demo's schema afterwards")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		return nil, fmt.Errorf("%w: %v", errUsage, err)
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("%w: unexpected argument %q", errUsage, fs.Arg(0))
	}
	fs.Visit(func(f *flag.Flag) { cfg.urlGiven = cfg.urlGiven || f.Name == "database-url" })
	if _, err := pgxpool.ParseConfig(cfg.databaseURL); err != nil {
		return nil, fmt.Errorf("%w: %v", errUsage, oneLine(parseURLError(err)))
	}
	if cfg.payments < 1 || cfg.accounts < 1 {
		return nil, fmt.Errorf("%w: --payments and --accounts must be positive", errUsage)
	}
	for _, b := range strings.Split(*brokers, ",") {
		if b = strings.TrimSpace(b); b == "" {
			continue
		}
		host, _, err := net.SplitHostPort(b)
		if err != nil {
			return nil, fmt.Errorf("%w: --brokers: %q is not host:port", errUsage, b)
		}
		if !*remote && !isLocalHost(host) {
			return nil, fmt.Errorf("%w: --brokers: %s is not on this machine; the demo creates a topic there and writes "+
				"to it: pass --allow-remote-brokers if that is what you want", errUsage, b)
		}
		cfg.brokers = append(cfg.brokers, b)
	}
	suffix := make([]byte, 6)
	_, _ = cryptorand.Read(suffix)
	cfg.schema = "onceflow_demo_" + hex.EncodeToString(suffix)
	return cfg, nil
}

// isLocalHost reports whether host names this machine: localhost or a
// loopback address.
func isLocalHost(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// demoProducers is how many producers write: four, or one per account
// when there are fewer.
func demoProducers(accounts int) int { return min(4, accounts) }

// demoAccountsOf returns the accounts producer w of n owns: w, w+n, w+2n, …
// Each account has one producer, so its payments are written in one
// producer's order.
func demoAccountsOf(w, n, accounts int) []int {
	var own []int
	for a := w; a < accounts; a += n {
		own = append(own, a)
	}
	return own
}

// demoEnv is the environment of the demo's child processes: this one's,
// less every ONCEFLOW_* variable (a relay pod's settings must not reach
// them), plus the given ones.
func demoEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "ONCEFLOW_") {
			env = append(env, kv)
		}
	}
	return append(env, extra...)
}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, err := parseDemoFlags(args, stderr)
	if err != nil {
		return err
	}
	c := common{databaseURL: cfg.databaseURL, schema: cfg.schema}
	var pool *pgxpool.Pool
	if !cfg.embedded {
		pool, err = c.connect(ctx)
	}
	if cfg.embedded || (err != nil && !cfg.urlGiven) {
		if err != nil {
			fmt.Fprintf(stdout, "0. no PostgreSQL at %s (%s)\n", redactURL(cfg.databaseURL), oneLine(err))
		}
		url, stopPG, perr := startEmbeddedPostgres(ctx, stdout)
		if perr != nil {
			return fmt.Errorf("start an embedded PostgreSQL: %w\nThe demo needs a PostgreSQL server: start the local one (pg_ctlcluster 15 main start), "+
				"or install it (apt-get install postgresql), or pass --database-url", perr)
		}
		defer stopPG()
		c.databaseURL = url
		pool, err = c.connect(ctx)
	}
	if err != nil {
		return fmt.Errorf("%w\nThe demo needs a PostgreSQL server: start the local one (pg_ctlcluster 15 main start), "+
			"or install it (apt-get install postgresql), or pass --database-url (without it, the demo starts an embedded PostgreSQL)", err)
	}
	defer pool.Close()

	say := func(format string, a ...any) { fmt.Fprintf(stdout, format+"\n", a...) }
	// A new schema: CREATE SCHEMA fails if the name is taken, so the DROP
	// below only ever drops what this run created.
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{c.schema}.Sanitize()); err != nil {
		return fmt.Errorf("create schema %s: %w", c.schema, err)
	}
	if !cfg.keep {
		defer pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{c.schema}.Sanitize()+" CASCADE")
	}
	if _, err := migrations.Up(ctx, pool, c.schema); err != nil {
		return err
	}
	if cfg.keep {
		say("1. migrated a new schema %s (kept afterwards: --keep)", c.schema)
	} else {
		say("1. migrated a new schema %s (dropped at the end)", c.schema)
	}
	ledger := pgx.Identifier{c.schema, "demo_ledger"}.Sanitize()
	paymentsTable := pgx.Identifier{c.schema, "demo_payments"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+paymentsTable+` (id bigserial PRIMARY KEY, account text NOT NULL, seq int NOT NULL, amount_cents bigint NOT NULL);
CREATE TABLE `+ledger+` (account text PRIMARY KEY, balance_cents bigint NOT NULL, last_seq int NOT NULL,
    out_of_order int NOT NULL DEFAULT 0, applications bigint NOT NULL DEFAULT 1)`); err != nil {
		return err
	}

	brokers := cfg.brokers
	if len(brokers) == 0 {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(100*time.Millisecond))
		if err != nil {
			return fmt.Errorf("start embedded Kafka: %w", err)
		}
		defer cluster.Close()
		brokers = cluster.ListenAddrs()
		say("2. started an embedded Kafka (kfake) at %s", strings.Join(brokers, ","))
	} else {
		say("2. using Kafka at %s", strings.Join(brokers, ","))
	}
	topic := fmt.Sprintf("demo.payments.%d", time.Now().UnixNano())
	admin, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return err
	}
	defer admin.Close()
	if resp, err := kadm.NewClient(admin).CreateTopic(ctx, 8, 1, nil, topic); err != nil || resp.Err != nil {
		return fmt.Errorf("create topic %s: %v", topic, errors.Join(err, resp.Err))
	}

	// Two relay processes: this same binary, run as `onceflow relay`.
	self, err := os.Executable()
	if err != nil {
		return err
	}
	relayEnv := demoEnv("ONCEFLOW_DATABASE_URL="+c.databaseURL, "ONCEFLOW_SCHEMA="+c.schema,
		"ONCEFLOW_BROKERS="+strings.Join(brokers, ","), "ONCEFLOW_LOG_LEVEL=error")
	startRelay := func(name string) (*exec.Cmd, error) {
		cmd := exec.Command(self, "relay", "--instance-id", name, "--lease-duration", "2s", "--poll-interval", "100ms")
		cmd.Env, cmd.Stderr = relayEnv, stderr
		return cmd, cmd.Start()
	}
	relays := map[string]*exec.Cmd{}
	for _, name := range []string{"relay-a", "relay-b"} {
		cmd, err := startRelay(name)
		if err != nil {
			return fmt.Errorf("start relay: %w", err)
		}
		relays[name] = cmd
	}
	defer func() {
		for _, cmd := range relays {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			_ = cmd.Wait()
		}
	}()
	say("3. started two relay processes (pids %d, %d)", relays["relay-a"].Process.Pid, relays["relay-b"].Process.Pid)

	// Two idempotent consumer processes (this binary, `onceflow demo-consumer`):
	// each adds a payment to its account and checks it arrives in order.
	consumerEnv := demoEnv("ONCEFLOW_DATABASE_URL="+c.databaseURL, "ONCEFLOW_SCHEMA="+c.schema,
		"ONCEFLOW_BROKERS="+strings.Join(brokers, ","))
	startConsumer := func() (*exec.Cmd, error) {
		cmd := exec.Command(self, "demo-consumer", "--topic", topic)
		cmd.Env, cmd.Stderr = consumerEnv, stderr
		return cmd, cmd.Start()
	}
	consumers := make([]*exec.Cmd, 2)
	for i := range consumers {
		if consumers[i], err = startConsumer(); err != nil {
			return fmt.Errorf("start consumer: %w", err)
		}
	}
	defer func() {
		for _, cmd := range consumers {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			_ = cmd.Wait()
		}
	}()
	applied := func() int64 {
		var n int64
		_ = pool.QueryRow(ctx, `SELECT coalesce(sum(applications), 0) FROM `+ledger).Scan(&n)
		return n
	}
	say("4. started two idempotent consumer processes (group demo-ledger; pids %d, %d)", consumers[0].Process.Pid, consumers[1].Process.Pid)

	// Producers: each owns some accounts, so per-account write order is
	// the producer's own order.
	writer, err := outbox.NewWriter(&outbox.Config{Schema: c.schema})
	if err != nil {
		return err
	}
	producers := demoProducers(cfg.accounts)
	var written atomic.Int64
	var wg sync.WaitGroup
	prodErr := make(chan error, producers)
	for w := range producers {
		own := demoAccountsOf(w, producers, cfg.accounts)
		mine := cfg.payments / producers
		if w < cfg.payments%producers {
			mine++
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			seqs := map[string]int{}
			for i := 0; i < mine; i += 20 {
				batch := min(20, mine-i)
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					var msgs []outbox.Message
					for range batch {
						account := fmt.Sprintf("acct-%d", own[rng.IntN(len(own))])
						seqs[account]++
						p := demoPayment{Account: account, AmountCents: int64(1 + rng.IntN(10000)), Seq: seqs[account]}
						if _, err := tx.Exec(ctx, `INSERT INTO `+paymentsTable+` (account, seq, amount_cents) VALUES ($1, $2, $3)`, p.Account, p.Seq, p.AmountCents); err != nil {
							return err
						}
						value, _ := json.Marshal(p)
						msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(account), Value: value})
					}
					return writer.Write(ctx, tx, msgs...)
				})
				if err != nil {
					prodErr <- err
					return
				}
				written.Add(int64(batch))
				time.Sleep(2 * time.Millisecond)
			}
		}()
	}
	say("5. %d producers write each payment and its event in one transaction", producers)

	progress := func() {
		var backlog int64
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{c.schema, "outbox"}.Sanitize()).Scan(&backlog)
		fmt.Fprintf(stdout, "\r   written %6d  backlog %6d  applied %6d ", written.Load(), backlog, applied())
	}
	// Mid-way: SIGKILL relay-a and restart it; re-insert 200 events that
	// were already published (same event_id), as a relay crash between
	// produce and delete would.
	killed, consumerKilled, duplicated := false, false, 0
	producersDone := make(chan struct{})
	go func() { wg.Wait(); close(producersDone) }()
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	deadline := time.Now().Add(5 * time.Minute)
	outboxTable := pgx.Identifier{c.schema, "outbox"}.Sanitize()
	for {
		select {
		case err := <-prodErr:
			return fmt.Errorf("producer: %w", err)
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
		progress()
		if !killed && written.Load() > int64(cfg.payments/3) {
			_ = relays["relay-a"].Process.Signal(syscall.SIGKILL)
			_ = relays["relay-a"].Wait()
			cmd, err := startRelay("relay-a2")
			if err != nil {
				return err
			}
			delete(relays, "relay-a")
			relays["relay-a2"] = cmd
			killed = true
			fmt.Fprintf(stdout, "\n   ! SIGKILLed relay-a mid-stream; started relay-a2 (pid %d); relay-b takes over its shards meanwhile\n", cmd.Process.Pid)
		}
		if !consumerKilled && written.Load() > int64(cfg.payments*6/10) && groupStable(ctx, admin, "demo-ledger", 2) {
			// Offsets are committed about once a second, so a SIGKILL
			// lands between some messages' database commit and their
			// offset commit: they are redelivered and must be skipped.
			_ = consumers[0].Process.Signal(syscall.SIGKILL)
			_ = consumers[0].Wait()
			if consumers[0], err = startConsumer(); err != nil {
				return err
			}
			consumerKilled = true
			fmt.Fprintf(stdout, "\n   ! SIGKILLed a consumer between its database commits and its offset commit; restarted it (pid %d)\n", consumers[0].Process.Pid)
		}
		if duplicated == 0 && written.Load() > int64(cfg.payments/2) {
			// Copy 200 events of the consumed topic back into the outbox.
			n, err := reinjectPublished(ctx, pool, outboxTable, brokers, topic, 200)
			if err != nil {
				return err
			}
			duplicated = n
			fmt.Fprintf(stdout, "\n   ! re-inserted %d already-published events (same message-id) into the outbox\n", n)
		}
		select {
		case <-producersDone:
		default:
			continue
		}
		var backlog int64
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM `+outboxTable).Scan(&backlog)
		if backlog == 0 && consumerKilled && applied() >= int64(cfg.payments) {
			break
		}
		if time.Now().After(deadline) {
			return errors.New("demo did not finish within 5 minutes")
		}
	}
	// Let the consumer drain whatever duplicates are still arriving.
	time.Sleep(time.Second)
	progress()
	fmt.Fprintln(stdout)
	return demoReport(ctx, pool, stdout, c.schema, paymentsTable, ledger, int64(cfg.payments), duplicated, applied())
}

// groupStable reports whether group is Stable with members members: a
// consumer killed while its group rebalances holds its partitions longer.
func groupStable(ctx context.Context, admin *kgo.Client, group string, members int) bool {
	groups, err := kadm.NewClient(admin).DescribeGroups(ctx, group)
	if err != nil {
		return false
	}
	g, ok := groups[group]
	return ok && g.Err == nil && g.State == "Stable" && len(g.Members) == members
}

const demoConsumerSummary = `Internal: the consumer process of 'onceflow demo'.`

// runDemoConsumer is one consumer process of the demo: it adds each
// payment to its account through the idempotent consumer.
func runDemoConsumer(ctx context.Context, args []string, _, stderr io.Writer) error {
	var c common
	fs := newFlagSet("demo-consumer", demoConsumerSummary, stderr)
	c.register(fs, true)
	topic := fs.String("topic", "", "topic to consume")
	if err := c.parse(ctx, fs, args, true); err != nil {
		return err
	}
	pool, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	ledger := pgx.Identifier{c.schema, "demo_ledger"}.Sanitize()
	proc, err := consumer.New(pool, "demo-ledger", func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		var p demoPayment
		if err := json.Unmarshal(msg.Value, &p); err != nil {
			return consumer.Permanent(err)
		}
		_, err := tx.Exec(ctx, `INSERT INTO `+ledger+` AS l (account, balance_cents, last_seq) VALUES ($1, $2, $3)
ON CONFLICT (account) DO UPDATE SET balance_cents = l.balance_cents + excluded.balance_cents,
    out_of_order = l.out_of_order + (excluded.last_seq <> l.last_seq + 1)::int,
    last_seq = excluded.last_seq, applications = l.applications + 1`, p.Account, p.AmountCents, p.Seq)
		return err
	}, &consumer.Config{Schema: c.schema, Concurrency: 8})
	if err != nil {
		return err
	}
	cons, err := kgoconsumer.New(proc, &kgoconsumer.Config{
		Brokers: c.brokerList(),
		Topics:  []string{*topic},
		// Short timeouts so a killed member's partitions move in seconds;
		// the session must outlast the rebalance timeout.
		ClientOpts: []kgo.Opt{kgo.SessionTimeout(8 * time.Second), kgo.RebalanceTimeout(5 * time.Second)},
	})
	if err != nil {
		return err
	}
	return cons.Run(ctx)
}

// reinjectPublished reads n records of topic and writes them into the outbox
// again with their message-id as event_id: duplicates the consumer must skip.
func reinjectPublished(ctx context.Context, pool *pgxpool.Pool, outboxTable string, brokers []string, topic string, n int) (int, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		return 0, err
	}
	defer cl.Close()
	readCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var recs []*kgo.Record
	for len(recs) < n && readCtx.Err() == nil {
		recs = append(recs, cl.PollFetches(readCtx).Records()...)
	}
	recs = recs[:min(n, len(recs))]
	for _, r := range recs {
		var id string
		for _, h := range r.Headers {
			if h.Key == outbox.MessageIDHeader {
				id = string(h.Value)
			}
		}
		if _, err := pool.Exec(ctx, `INSERT INTO `+outboxTable+` (event_id, topic, key, value) VALUES ($1, $2, $3, $4)`, id, r.Topic, r.Key, r.Value); err != nil {
			return 0, err
		}
	}
	return len(recs), nil
}

func demoReport(ctx context.Context, pool *pgxpool.Pool, w io.Writer, schema, paymentsTable, ledger string, want int64, duplicated int, applied int64) error {
	var paymentsCount, processed, dead, mismatched, outOfOrder int64
	err := pool.QueryRow(ctx, `SELECT
    (SELECT count(*) FROM `+paymentsTable+`),
    (SELECT count(*) FROM `+pgx.Identifier{schema, "processed_messages"}.Sanitize()+` WHERE consumer = 'demo-ledger'),
    (SELECT count(*) FROM `+pgx.Identifier{schema, "outbox_dead"}.Sanitize()+`),
    (SELECT count(*) FROM (SELECT account, sum(amount_cents) AS total FROM `+paymentsTable+` GROUP BY account) p
        FULL JOIN `+ledger+` l USING (account) WHERE p.total IS DISTINCT FROM l.balance_cents),
    (SELECT coalesce(sum(out_of_order), 0) FROM `+ledger+`)`).
		Scan(&paymentsCount, &processed, &dead, &mismatched, &outOfOrder)
	if err != nil {
		return err
	}
	ok := true
	check := func(pass bool, format string, a ...any) {
		mark := "ok  "
		if !pass {
			mark, ok = "FAIL", false
		}
		fmt.Fprintf(w, "   %s %s\n", mark, fmt.Sprintf(format, a...))
	}
	fmt.Fprintln(w, "6. report, read from the database:")
	check(paymentsCount == want, "%d payments committed with their events", paymentsCount)
	check(processed == want, "%d events applied by the consumer, one per payment (none lost, G2)", processed)
	check(applied == want, "%d payments applied to balances despite %d injected duplicates, a killed relay and a killed consumer (none twice, G5)", applied, duplicated)
	check(mismatched == 0, "every account's balance equals the sum of its payments (%d accounts differ)", mismatched)
	check(outOfOrder == 0, "per-account order held: %d payments arrived out of order (G3)", outOfOrder)
	check(dead == 0, "%d events dead-lettered", dead)
	if !ok {
		return errors.New("demo: a check failed")
	}
	fmt.Fprintln(w, "effectively once: every payment applied exactly once, in order.")
	return nil
}
