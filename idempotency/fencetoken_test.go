package idempotency_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgtest"
)

const fenceTokenChildEnv = "ONCEFLOW_FENCE_TOKEN_CHILD_URL"

// TestFenceTokenChild is the child process of
// TestFenceTokenRefusesAHolderPausedPastItsLease: it runs one Fence.Do
// whose fn calls the gateway with its context, key and fencing token.
func TestFenceTokenChild(t *testing.T) {
	url := os.Getenv(fenceTokenChildEnv)
	if url == "" {
		t.Skip("child of TestFenceTokenRefusesAHolderPausedPastItsLease")
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	f, err := idempotency.NewFence(pool, &idempotency.FenceConfig{Schema: os.Getenv("ONCEFLOW_FENCE_TOKEN_SCHEMA"), Namespace: "pay", Lease: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	fmt.Println("claiming")
	_, err = f.Do(ctx, "charge-1", func(ctx context.Context) ([]byte, error) {
		return callGateway(ctx, os.Getenv("ONCEFLOW_FENCE_TOKEN_GATEWAY"), "child")
	})
	fmt.Println("done", err)
}

func callGateway(ctx context.Context, url, who string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(who))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Idempotency-Key", idempotency.Key(ctx))
	req.Header.Set("Fence-Token", strconv.FormatInt(idempotency.FenceToken(ctx), 10))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	return io.ReadAll(resp.Body)
}

// helper 98: a Fence holder's cancellation runs on its own timers, the
// lease on the database's clock: a holder process paused (SIGSTOP here; a
// frozen VM or container, a throttled cgroup, a debugger) past its lease
// runs no timer, so nothing cancels its fn, while another caller takes the
// key over and runs fn again: two runs at once, which the docs said never
// happened. No fence can stop a paused process; what it can give is a
// fencing token. Here the first run's gateway call is in flight when its
// process is paused, the second run takes the key over and charges, and
// the gateway, which keeps the highest token seen per key and checks it
// when it commits a charge, refuses the first run's: its token is lower.
func TestFenceTokenRefusesAHolderPausedPastItsLease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var mu sync.Mutex
	highest := map[string]int64{} // per Idempotency-Key
	tokens := map[string]int64{}  // per caller
	keys := map[string]string{}   // per caller
	var charged, refused []string
	childArrived, childDone := make(chan struct{}), make(chan struct{})
	release := make(chan struct{})
	var releaseOnce sync.Once
	releaseChild := func() { releaseOnce.Do(func() { close(release) }) }
	gateway := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		who, _ := io.ReadAll(r.Body)
		key := r.Header.Get("Idempotency-Key")
		token, err := strconv.ParseInt(r.Header.Get("Fence-Token"), 10, 64)
		if err != nil || token <= 0 {
			t.Errorf("%s: Fence-Token %q", who, r.Header.Get("Fence-Token"))
		}
		mu.Lock()
		tokens[string(who)], keys[string(who)] = token, key
		highest[key] = max(highest[key], token)
		mu.Unlock()
		if string(who) == "child" {
			defer close(childDone)
			close(childArrived)
			select { // a slow gateway: the child is paused meanwhile
			case <-release:
			case <-r.Context().Done():
			}
		}
		mu.Lock()
		defer mu.Unlock()
		if token < highest[key] { // a later run holds the key: this one is stale
			refused = append(refused, string(who))
			http.Error(w, "stale fencing token", http.StatusConflict)
			return
		}
		charged = append(charged, string(who))
		_, _ = io.WriteString(w, "charged for "+string(who))
	}))
	t.Cleanup(gateway.Close)
	t.Cleanup(releaseChild)

	cmd := exec.Command(os.Args[0], "-test.run=^TestFenceTokenChild$", "-test.v")
	cmd.Env = append(os.Environ(), fenceTokenChildEnv+"="+pgtest.URL(t), "ONCEFLOW_FENCE_TOKEN_SCHEMA="+b.schema,
		"ONCEFLOW_FENCE_TOKEN_GATEWAY="+gateway.URL)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
		}
	}()
	select {
	case <-childArrived:
	case <-time.After(30 * time.Second):
		t.Fatal("timed out waiting for the child's fn to call the gateway")
	}
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil { // the holder pauses mid-call
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Signal(syscall.SIGCONT) }()
	table := pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()
	waitFor(t, 20*time.Second, "the paused holder's lease to lapse", func() bool {
		var lapsed bool
		_ = b.pool.QueryRow(context.Background(), `SELECT lease_until < now() FROM `+table+` WHERE key = 'charge-1'`).Scan(&lapsed)
		return lapsed
	})
	f := newFence(t, b, idempotency.FenceConfig{Namespace: "pay", Lease: time.Second})
	got, err := f.Do(context.Background(), "charge-1", func(ctx context.Context) ([]byte, error) {
		return callGateway(ctx, gateway.URL, "second")
	})
	if err != nil || string(got) != "charged for second" {
		t.Fatalf("second Do, after the paused holder's lease lapsed: %q, %v", got, err)
	}
	releaseChild() // the gateway commits the paused run's charge now
	select {
	case <-childDone:
	case <-time.After(10 * time.Second):
		t.Fatal("timed out waiting for the gateway to finish the child's call")
	}
	mu.Lock()
	defer mu.Unlock()
	if keys["child"] != keys["second"] {
		t.Errorf("the two runs passed different keys downstream: %q, %q", keys["child"], keys["second"])
	}
	if tokens["second"] <= tokens["child"] {
		t.Errorf("the run that took over has fencing token %d, the paused holder %d: want it greater", tokens["second"], tokens["child"])
	}
	if len(charged) != 1 || charged[0] != "second" || len(refused) != 1 || refused[0] != "child" {
		t.Errorf("charged %q, refused %q: want the second run charged and the paused holder refused by its token", charged, refused)
	}
}
