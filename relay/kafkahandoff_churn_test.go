package relay_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/relay"
)

// hoLog is the brokers: per key, the sequence numbers in order of first
// publication.
type hoLog struct {
	mu    sync.Mutex
	seen  map[string]bool
	first map[string][]int
}

func (l *hoLog) write(v string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.seen[v] {
		return
	}
	l.seen[v] = true
	k, s, _ := strings.Cut(v, "|")
	n, _ := strconv.Atoi(s)
	l.first[k] = append(l.first[k], n)
}

// bufClient models a producer client (franz-go's): records are queued in
// call order and delivered in that order once the way to the brokers is
// open; a Publish that times out leaves its records queued (they land
// later: the client still holds them). Ping fails while cut.
type bufClient struct {
	log  *hoLog
	mu   sync.Mutex
	cut  bool
	q    []*hoRec
	wake chan struct{}
	stop chan struct{}
	done chan struct{}
}

type hoRec struct {
	v    string
	done chan struct{}
}

func newBufClient(log *hoLog) *bufClient {
	c := &bufClient{log: log, wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	go c.flush()
	return c
}

func (c *bufClient) flush() {
	defer close(c.done)
	for {
		select {
		case <-c.stop:
			return
		case <-c.wake:
		case <-time.After(20 * time.Millisecond):
		}
		for {
			c.mu.Lock()
			if c.cut || len(c.q) == 0 {
				c.mu.Unlock()
				break
			}
			r := c.q[0]
			c.q = c.q[1:]
			c.mu.Unlock()
			c.log.write(r.v)
			close(r.done)
		}
	}
}

func (c *bufClient) setCut(cut bool) {
	c.mu.Lock()
	c.cut = cut
	c.mu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

func (c *bufClient) Publish(ctx context.Context, records []relay.Record) []error {
	recs := make([]*hoRec, len(records))
	c.mu.Lock()
	for i := range records {
		recs[i] = &hoRec{v: string(records[i].Value), done: make(chan struct{})}
		c.q = append(c.q, recs[i])
	}
	c.mu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
	errs := make([]error, len(records))
	for i, r := range recs {
		select {
		case <-r.done:
		case <-ctx.Done():
			for j := i; j < len(recs); j++ {
				select {
				case <-recs[j].done:
				default:
					errs[j] = fmt.Errorf("not acknowledged: %w", ctx.Err())
				}
			}
			return errs
		}
	}
	return errs
}

func (c *bufClient) Ping(ctx context.Context) error {
	c.mu.Lock()
	cut := c.cut
	c.mu.Unlock()
	if cut {
		return errCutOff
	}
	return nil
}

func (c *bufClient) Close() error {
	select {
	case <-c.stop:
	default:
		close(c.stop)
		<-c.done
	}
	return nil
}

// (Written by a cold review, helper 63.) Three relays; their ways to Kafka are cut and mended at random (two at
// once at times, sometimes all three), with records of timed-out rounds
// landing late. Each key's events must be first published in order (G3)
// and every event published (G2).
func TestHandoffChurnKeepsKeyOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	seed := uint64(time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(seed, 1))
	t.Logf("seed %d", seed)
	log := &hoLog{seen: map[string]bool{}, first: map[string][]int{}}
	var clients []*bufClient
	var relays []*relay.Relay
	for i := range 3 {
		c := newBufClient(log)
		clients = append(clients, c)
		r, _ := b.startRelayWith(t, b.pool, c, relay.Config{InstanceID: fmt.Sprint("r", i), BatchSize: 20,
			PublishTimeout: 150 * time.Millisecond, KafkaHandoff: time.Second, MaxRetryBackoff: 300 * time.Millisecond})
		relays = append(relays, r)
	}
	aside := 0
	outbox := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	const keys = 30
	seq := make([]int, keys)
	total := 0
	ctx := context.Background()
	end := time.Now().Add(20 * time.Second)
	var flips atomic.Int64
	for time.Now().Before(end) {
		// Write a few events.
		for range 5 {
			k := rng.IntN(keys)
			seq[k]++
			total++
			if _, err := b.pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key, value) VALUES ('t', $1, $2)`,
				[]byte(fmt.Sprint("k", k)), []byte(fmt.Sprintf("k%d|%d", k, seq[k]))); err != nil {
				t.Fatal(err)
			}
		}
		if rng.IntN(10) == 0 {
			c := clients[rng.IntN(len(clients))]
			c.mu.Lock()
			cut := c.cut
			c.mu.Unlock()
			c.setCut(!cut)
			flips.Add(1)
		}
		for _, r := range relays {
			if len(r.OwnedShards()) == 0 {
				aside++
			}
		}
		time.Sleep(time.Duration(10+rng.IntN(30)) * time.Millisecond)
	}
	for _, c := range clients {
		c.setCut(false)
	}
	waitFor(t, "the outbox to drain", 60*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	time.Sleep(200 * time.Millisecond)
	log.mu.Lock()
	defer log.mu.Unlock()
	published := 0
	for k := range keys {
		name := fmt.Sprint("k", k)
		got := log.first[name]
		published += len(got)
		for i := range got {
			if got[i] != i+1 {
				t.Fatalf("key %s: first publications %v (want 1..%d in order); %d flips", name, got, seq[k], flips.Load())
			}
		}
		if len(got) != seq[k] {
			t.Errorf("key %s: %d of %d events published", name, len(got), seq[k])
		}
	}
	t.Logf("%d events, %d published, %d flips, %d dead, %d samples of a relay holding no shard", total, published, flips.Load(), b.count(t, "outbox_dead"), aside)
}
