package otelonceflow_test

import (
	"bytes"
	"context"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/otelonceflow"
)

// commitCutter is a TCP proxy to PostgreSQL that, once armed, lets the next
// COMMIT through to the server and then closes both sides before the
// server's reply reaches the client: the transaction commits, the client
// sees its connection lost.
type commitCutter struct {
	ln    net.Listener
	armed atomic.Bool
	cuts  atomic.Int32
}

func newCommitCutter(t *testing.T, target string) *commitCutter {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &commitCutter{ln: ln}
	var wg sync.WaitGroup
	t.Cleanup(func() { _ = ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", target)
			if err != nil {
				_ = client.Close()
				continue
			}
			replied := make(chan struct{})
			wg.Add(2)
			go func() { defer wg.Done(); c.serverToClient(client, server, replied) }()
			go func() { defer wg.Done(); c.clientToServer(client, server, replied) }()
		}
	}()
	return c
}

// serverToClient closes replied when it could not pass on what the server
// sent: the reply to the cut COMMIT.
func (c *commitCutter) serverToClient(client, server net.Conn, replied chan struct{}) {
	defer client.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := server.Read(buf)
		if n > 0 {
			if _, werr := client.Write(buf[:n]); werr != nil {
				close(replied)
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (c *commitCutter) clientToServer(client, server net.Conn, replied <-chan struct{}) {
	defer server.Close()
	commit := append([]byte{'Q', 0, 0, 0, 11}, "commit\x00"...)
	buf := make([]byte, 32<<10)
	for {
		n, err := client.Read(buf)
		if n > 0 {
			if bytes.Contains(buf[:n], commit) && c.armed.CompareAndSwap(true, false) {
				c.cuts.Add(1)
				_ = client.Close() // before the reply can come back
				_, _ = server.Write(buf[:n])
				// Wait for the reply, dropped: the server committed.
				select {
				case <-replied:
				case <-time.After(5 * time.Second):
				}
				return
			}
			if _, werr := server.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

type doneEvents struct {
	mu  sync.Mutex
	evs []consumer.DoneEvent
}

func (d *doneEvents) OnDone(e consumer.DoneEvent) {
	d.mu.Lock()
	d.evs = append(d.evs, e)
	d.mu.Unlock()
}

// The handler ran and its transaction COMMITTED, but the reply was lost
// (the connection cut after the server got the COMMIT). The retry finds
// the dedup record: that is this delivery's own effect, so the message is
// reported processed, retried once, its handler run once, to HookDone
// and on the span alike. It was reported a duplicate whose handler did
// not run (onceflow.duplicate=true, retried=false) beside a retry event.
func TestLostCommitReplyIsReportedProcessed(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	direct, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	target := net.JoinHostPort(direct.ConnConfig.Host, strconv.Itoa(int(direct.ConnConfig.Port)))
	px := newCommitCutter(t, target)
	cfg, err := pgxpool.ParseConfig(strings.Replace(pgtest.URL(t), target, px.ln.Addr().String(), 1))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "oftest_lostcommit"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	schema := pgtest.Schema(t)
	var ran atomic.Int32
	done := &doneEvents{}
	p, err := consumer.New(pool, "shipping", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		ran.Add(1)
		px.armed.Store(true)
		return nil
	}, &consumer.Config{Schema: schema, MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond,
		Hooks: []consumer.Hook{otelonceflow.NewConsumer(otelonceflow.WithTracerProvider(tp)), done}})
	if err != nil {
		t.Fatal(err)
	}
	processOne(t, p, idHeader("lost-commit"))
	if px.cuts.Load() != 1 || ran.Load() != 1 {
		t.Fatalf("cuts %d, handler ran %d times: want one COMMIT cut, one run", px.cuts.Load(), ran.Load())
	}
	s := rec.Ended()[0]
	if attrOf(s, "onceflow.outcome") != "processed" || attrOf(s, "onceflow.duplicate") != "false" ||
		attrOf(s, "onceflow.attempts") != "1" || attrOf(s, "onceflow.retried") != "true" || len(s.Events()) != 1 {
		t.Errorf("span: outcome=%s duplicate=%s attempts=%s retried=%s, %d events; want processed, not a duplicate, 1 attempt, retried, one retry event",
			attrOf(s, "onceflow.outcome"), attrOf(s, "onceflow.duplicate"), attrOf(s, "onceflow.attempts"), attrOf(s, "onceflow.retried"), len(s.Events()))
	}
	done.mu.Lock()
	defer done.mu.Unlock()
	if len(done.evs) != 1 || done.evs[0].Outcome != consumer.Processed || done.evs[0].Attempts != 1 || done.evs[0].Retries != 1 {
		t.Errorf("done events %+v: want one, processed, 1 attempt, 1 retry", done.evs)
	}
}
