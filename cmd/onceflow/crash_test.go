package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/internal/proctest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

var (
	buildOnce sync.Once
	binary    string
	buildErr  error
)

// buildBinary builds cmd/onceflow once per test run.
func buildBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		var dir string
		dir, buildErr = proctest.Build(false, ".")
		binary = filepath.Join(dir, "onceflow")
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binary
}

// startRelayProc runs `onceflow relay args…`, killed when the test ends.
func startRelayProc(t *testing.T, bin string, env []string, args ...string) *proctest.Proc {
	t.Helper()
	p, err := proctest.Start(bin, env, append([]string{"relay"}, args...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	return p
}

// relayStarted reports whether a relay run with --log-level info is past its
// start-up checks (and has its signal handler installed).
func relayStarted(p *proctest.Proc) func() bool {
	return func() bool { return p.Printed("relay started") }
}

func relayEnv(t *testing.T, schema string, k *kafkatest.Kafka) []string {
	return []string{
		"ONCEFLOW_DATABASE_URL=" + pgtest.URL(t),
		"ONCEFLOW_SCHEMA=" + schema,
		"ONCEFLOW_BROKERS=" + strings.Join(k.Brokers, ","),
		"ONCEFLOW_LOG_LEVEL=warn",
	}
}

func waitUntil(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func count(t *testing.T, schema, table string) int {
	t.Helper()
	var n int
	if err := pgtest.Pool(t).QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{schema, table}.Sanitize()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestCrashRelaysWhileWriting: three relay processes drain events while
// writers add more; relays are SIGKILLed at random moments and restarted.
// At the end every event is in Kafka (G2), every record's message-id maps to
// exactly one event (G4), and per key the first occurrences follow write
// order (G3).
func TestCrashRelaysWhileWriting(t *testing.T) {
	if testing.Short() {
		t.Skip("crash test builds and kills processes; skipped with -short")
	}
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("ONCEFLOW_TEST_SEED"); s != "" {
		fmt.Sscan(s, &seed)
	}
	t.Logf("seed %d (set ONCEFLOW_TEST_SEED to replay)", seed)
	rng := rand.New(rand.NewPCG(seed, 0))

	bin := buildBinary(t)
	schema := pgtest.Schema(t)
	k := kafkatest.New(t)
	topic := k.Topic(t, 8)
	env := relayEnv(t, schema, k)
	relayArgs := []string{"--lease-duration", "1s", "--poll-interval", "100ms", "--batch-size", "500", "--log-level", "info"}

	const writers, keysPerWriter, txPerWriter, eventsPerTx = 4, 50, 110, 50 // 22,000 events
	type event struct {
		key string
		seq int
	}
	var mu sync.Mutex
	events := map[string]event{}
	writer, _ := outbox.NewWriter(&outbox.Config{Schema: schema})

	relays := make([]*proctest.Proc, 3)
	for i := range relays {
		relays[i] = startRelayProc(t, bin, env, relayArgs...)
	}

	ctx := context.Background()
	var wg sync.WaitGroup
	writeErr := make(chan error, writers)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			seqs := make([]int, keysPerWriter)
			for tx := range txPerWriter {
				msgs := make([]outbox.Message, eventsPerTx)
				batch := map[string]event{}
				for i := range msgs {
					kn := (tx*eventsPerTx + i) % keysPerWriter
					key := fmt.Sprintf("w%d-k%d", w, kn)
					ev := event{key: key, seq: seqs[kn]}
					seqs[kn]++
					id := outbox.NewID()
					msgs[i] = outbox.Message{ID: id, Topic: topic, Key: []byte(key), Value: []byte(fmt.Sprintf("%s:%d", key, ev.seq))}
					batch[id] = ev
				}
				err := pgx.BeginFunc(ctx, pgtest.Pool(t), func(tx pgx.Tx) error { return writer.Write(ctx, tx, msgs...) })
				if err != nil {
					writeErr <- err
					return
				}
				mu.Lock()
				for id, ev := range batch {
					events[id] = ev
				}
				mu.Unlock()
				time.Sleep(5 * time.Millisecond)
			}
		}()
	}
	writersDone := make(chan struct{})
	go func() { wg.Wait(); close(writersDone) }()

	kills := 0
	killUntil := time.Now().Add(20 * time.Second)
	for {
		select {
		case err := <-writeErr:
			t.Fatalf("writer: %v", err)
		default:
		}
		writing := true
		select {
		case <-writersDone:
			writing = false
		default:
		}
		if !writing && (kills >= 6 || time.Now().After(killUntil)) {
			break
		}
		time.Sleep(time.Duration(200+rng.IntN(600)) * time.Millisecond)
		i := rng.IntN(len(relays))
		relays[i].Kill()
		kills++
		relays[i] = startRelayProc(t, bin, env, relayArgs...)
	}
	t.Logf("%d relays SIGKILLed", kills)
	total := writers * txPerWriter * eventsPerTx
	waitUntil(t, "the outbox to drain", 120*time.Second, func() bool { return count(t, schema, "outbox") == 0 })

	for _, r := range relays {
		// A signal before main installs its handler would kill by default.
		waitUntil(t, "a restarted relay to start", 30*time.Second, relayStarted(r))
		_ = r.Signal(syscall.SIGTERM)
	}
	for _, r := range relays {
		err, exited := r.Wait(30 * time.Second)
		switch {
		case !exited:
			t.Errorf("relay did not exit within 30s of SIGTERM")
		case err != nil:
			t.Errorf("relay exit after SIGTERM: %v\n%s", err, r.Output())
		}
	}
	if n := count(t, schema, "outbox_dead"); n != 0 {
		t.Fatalf("%d events dead-lettered", n)
	}
	if len(events) != total {
		t.Fatalf("writers recorded %d events, want %d", len(events), total)
	}

	records := k.ReadAll(t, topic, total, 60*time.Second)
	seen := map[string]bool{}
	nextSeq := map[string]int{}
	dups := 0
	for _, r := range records {
		id := headerValue(r, relay.MessageIDHeader)
		ev, ok := events[id]
		if !ok {
			t.Fatalf("record with message-id %q maps to no event", id)
		}
		if string(r.Key) != ev.key || string(r.Value) != fmt.Sprintf("%s:%d", ev.key, ev.seq) {
			t.Fatalf("record %s: key %q value %q, event is %+v", id, r.Key, r.Value, ev)
		}
		if seen[id] {
			dups++
			continue
		}
		seen[id] = true
		if ev.seq != nextSeq[ev.key] {
			t.Fatalf("key %s: first publication of seq %d came when seq %d was due", ev.key, ev.seq, nextSeq[ev.key])
		}
		nextSeq[ev.key]++
	}
	if len(seen) != total {
		t.Fatalf("%d of %d events reached Kafka", len(seen), total)
	}
	t.Logf("%d events, %d records (%d re-sent after crashes)", total, len(records), dups)
}

// A SIGKILLed relay's shards move to the survivor within 10 s with the
// default lease.
func TestKilledRelayShardsTakenOverWithin10s(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and kills processes; skipped with -short")
	}
	t.Parallel()
	bin := buildBinary(t)
	schema := pgtest.Schema(t)
	k := kafkatest.New(t)
	env := relayEnv(t, schema, k)
	a := startRelayProc(t, bin, env, "--instance-id", "a")
	startRelayProc(t, bin, env, "--instance-id", "b")
	owned := func(id string) int {
		st, err := relay.ReadStatus(context.Background(), pgtest.Pool(t), schema)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range st.Relays {
			if r.ID == id {
				return len(r.Shards)
			}
		}
		return 0
	}
	waitUntil(t, "a and b to split the shards", 30*time.Second, func() bool { return owned("a") == 128 && owned("b") == 128 })
	a.Kill()
	killed := time.Now()
	waitUntil(t, "b to own every shard", 15*time.Second, func() bool { return owned("b") == relay.NumShards })
	if d := time.Since(killed); d > 10*time.Second {
		t.Fatalf("takeover took %s, want at most 10s", d)
	} else {
		t.Logf("takeover after %s", d.Round(time.Millisecond))
	}
}

func headerValue(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}
