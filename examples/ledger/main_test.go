package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/examples/internal/exampletest"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
)

var bin string

func TestMain(m *testing.M) {
	b, cleanup, err := exampletest.Build("ledger")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin = b
	code := m.Run()
	cleanup()
	os.Exit(code)
}

var consuming = regexp.MustCompile(`ledger: consuming`)

// fixture is one test's database schema (onceflow's tables and the ledger),
// Kafka and topic.
type fixture struct {
	schema string // onceflow's tables
	app    string // the connection's default schema: ledger_accounts
	url    string // database URL with search_path = app
	kafka  *kafkatest.Kafka
	topic  string
}

func (f *fixture) start(t *testing.T) *exampletest.Proc {
	return exampletest.Start(t, bin, "--database-url", f.url, "--brokers", f.kafka.Brokers[0],
		"--schema", f.schema, "--topic", f.topic, "--group", "ledger")
}

// event is one payment to publish: id is its message-id.
type event struct {
	id      string
	account string
	cents   int64
}

func (f *fixture) publish(t *testing.T, cl *kgo.Client, ps ...event) {
	t.Helper()
	recs := make([]*kgo.Record, len(ps))
	for i, p := range ps {
		recs[i] = &kgo.Record{
			Topic:   f.topic,
			Key:     []byte(p.account),
			Value:   fmt.Appendf(nil, `{"account":%q,"amount_cents":%d}`, p.account, p.cents),
			Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte(p.id)}},
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
}

// waitConsumed waits until the group has committed every partition's end
// offset: every record, duplicates included, has been handled.
func (f *fixture) waitConsumed(t *testing.T) {
	t.Helper()
	adm := f.kafka.Admin(t)
	exampletest.Eventually(t, 30*time.Second, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		ends, err := adm.ListEndOffsets(ctx, f.topic)
		if err != nil {
			return err
		}
		committed, err := adm.FetchOffsets(ctx, "ledger")
		if err != nil {
			return err
		}
		var lag error
		ends.Each(func(end kadm.ListedOffset) {
			if end.Offset == 0 {
				return // nothing to consume
			}
			c, ok := committed.Lookup(end.Topic, end.Partition)
			if !ok || c.At < end.Offset {
				lag = fmt.Errorf("partition %d: committed %d (found %v), end %d", end.Partition, c.At, ok, end.Offset)
			}
		})
		return lag
	})
}

// balances reads ledger_accounts.
func (f *fixture) balances(t *testing.T) map[string]int64 {
	t.Helper()
	rows, err := pgtest.Pool(t).Query(context.Background(),
		`SELECT account, balance_cents FROM `+pgx.Identifier{f.app, "ledger_accounts"}.Sanitize())
	if err != nil {
		t.Fatalf("read balances: %v", err)
	}
	got := map[string]int64{}
	var account string
	var cents int64
	if _, err := pgx.ForEachRow(rows, []any{&account, &cents}, func() error {
		got[account] = cents
		return nil
	}); err != nil {
		t.Fatalf("read balances: %v", err)
	}
	return got
}

func wantBalances(t *testing.T, got, want map[string]int64) {
	t.Helper()
	if fmt.Sprint(got) != fmt.Sprint(want) { // fmt sorts map keys
		t.Fatalf("balances = %v, want %v", got, want)
	}
}

// payments returns n payments with fresh ids, spread over five accounts, and
// adds them to want.
func payments(prefix string, n int, want map[string]int64) []event {
	ps := make([]event, n)
	for i := range ps {
		ps[i] = event{
			id:      fmt.Sprintf("%s-%04d", prefix, i),
			account: fmt.Sprintf("a%d", i%5),
			cents:   int64(100 + i),
		}
		want[ps[i].account] += ps[i].cents
	}
	return ps
}

// Payments delivered several times, at new offsets and across a restart,
// change balances once; a payment that is not JSON goes to the dead-letter
// topic; SIGTERM stops the worker with exit code 0.
func TestLedgerExactBalances(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	f := &fixture{schema: schema, app: schema, url: exampletest.WithSearchPath(t, pgtest.URL(t), schema), kafka: kafkatest.New(t)}
	f.topic = f.kafka.Topic(t, 3)
	f.kafka.CreateTopic(t, f.topic+".dlq", 1, nil)
	cl := f.kafka.Client(t)

	want := map[string]int64{}
	first := payments("p", 60, want)
	f.publish(t, cl, first...)
	f.publish(t, cl, first[:20]...) // the same message ids again, at new offsets
	bad := &kgo.Record{Topic: f.topic, Value: []byte(`{"account":`),
		Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte("bad-1")}}}
	if err := cl.ProduceSync(context.Background(), bad).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}

	p := f.start(t)
	p.WaitOutput(t, consuming, 30*time.Second)
	f.publish(t, cl, first[10:40]...) // duplicates while it runs
	f.waitConsumed(t)
	wantBalances(t, f.balances(t), want)

	dead := f.kafka.ReadAll(t, f.topic+".dlq", 1, 10*time.Second)
	if len(dead) != 1 || string(dead[0].Value) != `{"account":` {
		t.Fatalf("dead letters = %d records, want the one bad payment", len(dead))
	}
	if h := header(dead[0], "onceflow-error"); h == "" {
		t.Fatalf("dead letter has no onceflow-error header: %v", dead[0].Headers)
	}
	p.Stop(t, 20*time.Second)

	// A new process sees old ids again (a producer re-send) and new ones.
	more := payments("q", 20, want)
	f.publish(t, cl, append(more, first[30:]...)...)
	p = f.start(t)
	p.WaitOutput(t, consuming, 30*time.Second)
	f.waitConsumed(t)
	wantBalances(t, f.balances(t), want)

	var processed int
	if err := pgtest.Pool(t).QueryRow(context.Background(),
		`SELECT count(*) FROM `+pgx.Identifier{schema, "processed_messages"}.Sanitize()+` WHERE consumer = 'ledger'`).Scan(&processed); err != nil {
		t.Fatal(err)
	}
	if processed != len(first)+len(more) {
		t.Fatalf("processed_messages = %d, want %d", processed, len(first)+len(more))
	}
	p.Stop(t, 20*time.Second)
}

// Two workers started at the same moment on a database that has neither
// onceflow's tables nor the ledger: both migrate, create the table, join the
// group and share the work; balances are exact.
func TestLedgerTwoProcessesStartTogether(t *testing.T) {
	t.Parallel()
	app := pgtest.EmptySchema(t)
	if _, err := pgtest.Pool(t).Exec(context.Background(), `CREATE SCHEMA `+pgx.Identifier{app}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	f := &fixture{schema: pgtest.EmptySchema(t), app: app, url: exampletest.WithSearchPath(t, pgtest.URL(t), app), kafka: kafkatest.New(t)}
	f.topic = f.kafka.Topic(t, 4)
	cl := f.kafka.Client(t)

	a, b := f.start(t), f.start(t)
	a.WaitOutput(t, consuming, 30*time.Second)
	b.WaitOutput(t, consuming, 30*time.Second)

	want := map[string]int64{}
	ps := payments("p", 80, want)
	f.publish(t, cl, ps...)
	for i := 0; i < len(ps); i += 3 {
		f.publish(t, cl, ps[i]) // duplicates at new offsets
	}
	f.waitConsumed(t)
	wantBalances(t, f.balances(t), want)

	a.Stop(t, 20*time.Second)
	b.Stop(t, 20*time.Second)
}

// The worker runs the consumer's janitor: dedup records older than the
// window are deleted, whichever consumer's, newer ones kept.
func TestLedgerRunsTheJanitor(t *testing.T) {
	t.Parallel()
	schema := pgtest.Schema(t)
	f := &fixture{schema: schema, app: schema, url: exampletest.WithSearchPath(t, pgtest.URL(t), schema), kafka: kafkatest.New(t)}
	f.topic = f.kafka.Topic(t, 1)
	pool := pgtest.Pool(t)
	table := pgx.Identifier{schema, "processed_messages"}.Sanitize()
	if _, err := pool.Exec(context.Background(), `INSERT INTO `+table+` (consumer, message_id, processed_at) VALUES
		('ledger', 'expired', now() - interval '16 days'),
		('other', 'another consumers', now() - interval '30 days'),
		('ledger', 'kept', now() - interval '14 days')`); err != nil {
		t.Fatal(err)
	}

	p := f.start(t)
	p.WaitOutput(t, consuming, 30*time.Second)
	left := func() (ids []string) {
		rows, err := pool.Query(context.Background(), `SELECT message_id FROM `+table+` ORDER BY message_id`)
		if err != nil {
			t.Fatal(err)
		}
		ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}
	exampletest.Eventually(t, 30*time.Second, func() error {
		if ids := left(); len(ids) != 1 || ids[0] != "kept" {
			return fmt.Errorf("processed_messages holds %v, want only the record inside the window", ids)
		}
		return nil
	})
	p.Stop(t, 20*time.Second)
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// helper 121: the example took ONCEFLOW_DATABASE_URL as --database-url's
// default, so --help printed the URL, password and all; and an unparsable
// URL came back in "connect: …" (net/url quotes it whole). The binary
// avoids both; so do the examples now, which users copy.
func TestExampleDoesNotPrintTheDatabasePassword(t *testing.T) {
	for _, args := range [][]string{{"--help"}, {"--database-url", "postgres://u:hunter2@db.invalid:port/x", "--brokers", "k:9092"}} {
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), "ONCEFLOW_DATABASE_URL=postgres://u:hunter2@db.invalid/x", "ONCEFLOW_BROKERS=k:9092")
		out, _ := cmd.CombinedOutput()
		if strings.Contains(string(out), "hunter2") {
			t.Errorf("%v prints the database password:\n%s", args, out)
		}
	}
}
