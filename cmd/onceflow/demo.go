package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
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

	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
	"github.com/testcontainers/testcontainers-go/wait"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/consumer/kgoconsumer"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
)

const demoSummary = `Run the whole story on this machine: migrate a fresh schema, start an
embedded Kafka (kfake) unless --brokers is given, write payments and their
events in one transaction from several producers, publish them with two relay
processes and apply them with two idempotent consumer processes (one of
each is SIGKILLed and restarted mid-way), inject duplicate events, then check from the data that
no event was lost, none was applied twice and per-account order held.
Exit status 1 if any check fails.

Needs PostgreSQL only: --database-url defaults to the local server
(postgres://postgres@127.0.0.1:5432/postgres).`

type demoPayment struct {
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
	Seq         int    `json:"seq"`
}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlagSet("demo", demoSummary, stderr)
	c.register(fs, true)
	payments := fs.Int("payments", 20000, "payments to write")
	accounts := fs.Int("accounts", 200, "accounts (the event key: per-account order is checked)")
	keep := fs.Bool("keep", false, "keep the demo schema afterwards")
	if c.databaseURL == "" {
		_ = fs.Set("database-url", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
	}
	if err := c.parse(fs, args, false); err != nil {
		return err
	}
	if *payments < 1 || *accounts < 1 {
		return fmt.Errorf("%w: --payments and --accounts must be positive", errUsage)
	}
	pool, err := c.connect(ctx)
	if err != nil && pgtest.DockerHealthy() {
		fmt.Fprintf(stdout, "0. no PostgreSQL at the given URL (%s); starting one in Docker with testcontainers\n", oneLine(err))
		url, cerr := startPostgresContainer(ctx)
		if cerr != nil {
			return fmt.Errorf("start a PostgreSQL container: %w", cerr)
		}
		c.databaseURL = url
		pool, err = c.connect(ctx)
	}
	if err != nil {
		return fmt.Errorf("%w\nThe demo needs a PostgreSQL server: start the local one (pg_ctlcluster 15 main start), "+
			"or install it (apt-get install postgresql), or run a Docker engine, or pass --database-url", err)
	}
	defer pool.Close()

	if c.schema == migrations.DefaultSchema {
		c.schema = fmt.Sprintf("onceflow_demo_%d", time.Now().Unix())
	}
	say := func(format string, a ...any) { fmt.Fprintf(stdout, format+"\n", a...) }
	if _, err := migrations.Up(ctx, pool, c.schema); err != nil {
		return err
	}
	if !*keep {
		defer pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{c.schema}.Sanitize()+" CASCADE")
	}
	say("1. migrated schema %s", c.schema)
	ledger := pgx.Identifier{c.schema, "demo_ledger"}.Sanitize()
	paymentsTable := pgx.Identifier{c.schema, "demo_payments"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+paymentsTable+` (id bigserial PRIMARY KEY, account text NOT NULL, seq int NOT NULL, amount_cents bigint NOT NULL);
CREATE TABLE `+ledger+` (account text PRIMARY KEY, balance_cents bigint NOT NULL, last_seq int NOT NULL,
    out_of_order int NOT NULL DEFAULT 0, applications bigint NOT NULL DEFAULT 1)`); err != nil {
		return err
	}

	brokers := c.brokerList()
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
	relayEnv := append(os.Environ(), "ONCEFLOW_DATABASE_URL="+c.databaseURL, "ONCEFLOW_SCHEMA="+c.schema,
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
	consumerEnv := append(os.Environ(), "ONCEFLOW_DATABASE_URL="+c.databaseURL, "ONCEFLOW_SCHEMA="+c.schema,
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
	const producers = 4
	var written atomic.Int64
	var wg sync.WaitGroup
	prodErr := make(chan error, producers)
	perProducer := *payments / producers
	for w := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			seqs := map[string]int{}
			for i := 0; i < perProducer; i += 20 {
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					var msgs []outbox.Message
					for j := i; j < min(i+20, perProducer); j++ {
						account := fmt.Sprintf("acct-%d", (rng.IntN(*accounts/producers+1)*producers+w)%*accounts)
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
				written.Add(20)
				time.Sleep(2 * time.Millisecond)
			}
		}()
	}
	say("5. four producers write each payment and its event in one transaction")

	progress := func() {
		var backlog int64
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{c.schema, "outbox"}.Sanitize()).Scan(&backlog)
		fmt.Fprintf(stdout, "\r   written %6d  backlog %6d  applied %6d ", min(written.Load(), int64(perProducer*producers)), backlog, applied())
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
		if !killed && written.Load() > int64(*payments/3) {
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
		if !consumerKilled && written.Load() > int64(*payments*6/10) && groupStable(ctx, admin, "demo-ledger", 2) {
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
		if duplicated == 0 && written.Load() > int64(*payments/2) {
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
		if backlog == 0 && consumerKilled && applied() >= int64(perProducer*producers) {
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
	return demoReport(ctx, pool, stdout, c.schema, paymentsTable, ledger, int64(perProducer*producers), duplicated, applied())
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

// startPostgresContainer runs PostgreSQL 15 in Docker for the demo.
func startPostgresContainer(ctx context.Context) (string, error) {
	c, err := tcpostgres.Run(ctx, "postgres:15-alpine",
		tcpostgres.WithDatabase("postgres"), tcpostgres.WithUsername("postgres"), tcpostgres.WithPassword("postgres"),
		testcontainers.WithWaitStrategy(wait.ForLog("database system is ready to accept connections").WithOccurrence(2)))
	if err != nil {
		return "", err
	}
	return c.ConnectionString(ctx, "sslmode=disable")
}

const demoConsumerSummary = `Internal: the consumer process of 'onceflow demo'.`

// runDemoConsumer is one consumer process of the demo: it adds each
// payment to its account through the idempotent consumer.
func runDemoConsumer(ctx context.Context, args []string, _, stderr io.Writer) error {
	var c common
	fs := newFlagSet("demo-consumer", demoConsumerSummary, stderr)
	c.register(fs, true)
	topic := fs.String("topic", "", "topic to consume")
	if err := c.parse(fs, args, true); err != nil {
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
