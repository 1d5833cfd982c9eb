package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
)

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func httpGet(url string) (int, string) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// The relay binary serves /healthz and Prometheus /metrics with the figures
// operators watch, and exits 0 on SIGTERM.
func TestRelayServesMetricsAndHealth(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary; skipped with -short")
	}
	t.Parallel()
	bin := buildBinary(t)
	schema := pgtest.Schema(t)
	k := kafkatest.New(t)
	topic := k.Topic(t, 2)
	addr := freeAddr(t)
	p := startRelayProc(t, bin, relayEnv(t, schema, k), "--http-addr", addr, "--log-level", "info")
	waitUntil(t, "the relay to start", 30*time.Second, relayStarted(p))
	w, _ := outbox.NewWriter(&outbox.Config{Schema: schema})
	var msgs []outbox.Message
	for i := range 50 {
		msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint(i % 3)), Value: []byte("v")})
	}
	msgs = append(msgs, outbox.Message{Topic: topic, Value: make([]byte, 2<<20)}) // dead-lettered
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, pgtest.Pool(t), func(tx pgx.Tx) error { return w.Write(ctx, tx, msgs...) }); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the outbox to drain", 30*time.Second, func() bool { return count(t, schema, "outbox") == 0 })

	if code, body := httpGet("http://" + addr + "/healthz"); code != 200 || !strings.Contains(body, "ok") {
		t.Fatalf("/healthz: %d %q", code, body)
	}
	var metrics string
	waitUntil(t, "published events in /metrics", 10*time.Second, func() bool {
		_, metrics = httpGet("http://" + addr + "/metrics")
		return strings.Contains(metrics, "onceflow_relay_published_total 50")
	})
	for _, want := range []string{
		"onceflow_relay_dead_lettered_total 1",
		"onceflow_relay_owned_shards 256",
		`onceflow_build_info{goversion="go`,
		"onceflow_outbox_backlog_events 0",
		"onceflow_outbox_dead_events 1",
		"onceflow_outbox_scrape_ok 1",
		"onceflow_relay_round_seconds_count",
		"onceflow_relay_publish_timeouts_total 0",
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	_ = p.Signal(syscall.SIGTERM)
	if err, exited := p.Wait(30 * time.Second); !exited || err != nil {
		t.Fatalf("after SIGTERM: exited %v, err %v", exited, err)
	}
}
