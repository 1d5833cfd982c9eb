package idempotency_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
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

const h98FenceChildEnv = "H98_FENCE_CHILD_URL"

// TestH98FenceChild is the child process of
// TestFenceHolderPausedPastItsLeaseOverlapsASecondRun: it runs one Fence.Do
// whose fn calls the gateway with its context, as the docs ask.
func TestH98FenceChild(t *testing.T) {
	url := os.Getenv(h98FenceChildEnv)
	if url == "" {
		t.Skip("child of TestFenceHolderPausedPastItsLeaseOverlapsASecondRun")
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	f, err := idempotency.NewFence(pool, &idempotency.FenceConfig{Schema: os.Getenv("H98_SCHEMA"), Namespace: "pay", Lease: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	fmt.Println("claiming")
	_, err = f.Do(ctx, "charge-1", func(ctx context.Context) ([]byte, error) {
		return callGateway(ctx, os.Getenv("H98_GATEWAY"), "child")
	})
	fmt.Println("done", err)
}

func callGateway(ctx context.Context, url, who string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(who))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Idempotency-Key", idempotency.Key(ctx))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	return io.ReadAll(resp.Body)
}

// helper 98: Fence.Do's docs: "If lease renewals fail, fn's context is
// cancelled before the lease lapses: an fn that honours its context never
// runs concurrently with another run of the key", and the fence "makes
// re-runs rare and never concurrent". The lease is judged on the database's
// clock, the holder's cancellation on the holder's own timers: a holder
// process that is paused (SIGSTOP here; a frozen VM or container, a
// throttled cgroup, a debugger) past its lease runs no timer, so nothing
// cancels its fn, while another caller takes the key over and runs fn
// again. Here the first run's gateway call is still in flight (an fn that
// honours its context, paused mid-call) when the second run calls the
// gateway: two runs at once. There is no fencing token a downstream could
// use to refuse the stale run (Key(ctx) is the same for both).
func TestFenceHolderPausedPastItsLeaseOverlapsASecondRun(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var mu sync.Mutex
	inflight, maxInflight := 0, 0
	var calls []string
	release := make(chan struct{})
	gateway := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		who, _ := io.ReadAll(r.Body)
		mu.Lock()
		inflight++
		maxInflight = max(maxInflight, inflight)
		calls = append(calls, string(who))
		mu.Unlock()
		defer func() { mu.Lock(); inflight--; mu.Unlock() }()
		if string(who) == "child" {
			select { // a slow gateway: the child is paused meanwhile
			case <-release:
			case <-r.Context().Done():
			}
		}
		_, _ = io.WriteString(w, "charged for "+string(who))
	}))
	t.Cleanup(gateway.Close)
	t.Cleanup(func() { close(release) })

	cmd := exec.Command(os.Args[0], "-test.run=^TestH98FenceChild$", "-test.v")
	cmd.Env = append(os.Environ(), h98FenceChildEnv+"="+pgtest.URL(t), "H98_SCHEMA="+b.schema, "H98_GATEWAY="+gateway.URL)
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
	waitFor(t, 30*time.Second, "the child's fn to call the gateway", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return inflight == 1
	})
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
	_, err = f.Do(context.Background(), "charge-1", func(ctx context.Context) ([]byte, error) {
		return callGateway(ctx, gateway.URL, "second")
	})
	mu.Lock()
	defer mu.Unlock()
	if !errors.Is(err, idempotency.ErrInProgress) || maxInflight > 1 {
		t.Fatalf("second Do while the first run (paused, its fn honouring its context) was still in its gateway call: err=%v; "+
			"gateway calls %q, at most %d in flight at once; want ErrInProgress and never 2 runs at once", err, calls, maxInflight)
	}
}
