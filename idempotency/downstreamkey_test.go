package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/onceflow/onceflow/idempotency"
)

// helper 98: keys are scoped by Config.Scope ("the same key from two
// principals is two operations"), and the docs tell Leased handlers to
// "pass idempotency.Key(ctx) to the downstream service and let it
// deduplicate too". Key(ctx) was the client's bare key, without its
// scope: two principals who both send "order-1" (clients pick keys
// independently: counters, their own order ids) reached the downstream with
// one key, and a payment gateway deduplicating on the key, as Stripe does
// per account, answered Bob with Alice's charge and nobody charged Bob.
// Key(ctx) is now derived from the scope and the key.
func TestLeasedKeyPassedDownstreamKeepsPrincipalsApart(t *testing.T) {
	t.Parallel()
	b := setup(t)

	// The gateway: charges once per Idempotency-Key and replays that charge
	// for the key afterwards.
	var mu sync.Mutex
	charges := map[string]string{}
	var charged []string
	gateway := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		k := r.Header.Get("Idempotency-Key")
		if prior, ok := charges[k]; ok {
			_, _ = io.WriteString(w, prior)
			return
		}
		charged = append(charged, string(body))
		c := fmt.Sprintf("ch_%d %s", len(charged), body)
		charges[k] = c
		_, _ = io.WriteString(w, c)
	}))
	t.Cleanup(gateway.Close)

	srv := newServer(t, b, idempotency.Config{Mode: idempotency.Leased}, func(w http.ResponseWriter, r *http.Request) {
		req, _ := http.NewRequestWithContext(r.Context(), http.MethodPost, gateway.URL+"/charges",
			strings.NewReader("customer="+r.Header.Get("X-User")))
		req.Header.Set("Idempotency-Key", idempotency.Key(r.Context())) // as the docs say
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		charge, _ := io.ReadAll(resp.Body)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(charge)
	})
	alice := send(t, srv, request{key: "order-1", user: "alice", body: `{"amount_cents":5000}`})
	bob := send(t, srv, request{key: "order-1", user: "bob", body: `{"amount_cents":5000}`})
	if alice.status != http.StatusCreated || bob.status != http.StatusCreated || bob.replayed {
		t.Fatalf("alice %d, bob %d replayed=%v: want two first runs", alice.status, bob.status, bob.replayed)
	}
	mu.Lock()
	defer mu.Unlock()
	if !strings.Contains(bob.body, "customer=bob") || len(charged) != 2 {
		t.Fatalf("two principals' first requests under the same client key: alice got %q, bob got %q; the gateway charged %d time(s) %q; "+
			"want each charged once (Key(ctx) is unscoped, so the downstream merged them)", alice.body, bob.body, len(charged), charged)
	}
}

// Key(ctx) is the same on every retry of a scope's key, differs between
// scopes (principals, fence namespaces, and HTTP against fences), fits a
// 255-byte key limit, and ClientKey(ctx) is the key as sent.
func TestKeyIsScopedStableAndShort(t *testing.T) {
	t.Parallel()
	b := setup(t)
	long := strings.Repeat("k", 255)
	var mu sync.Mutex
	seen := map[string][]string{} // "user client-key" -> Key(ctx) per run
	srv := newServer(t, b, idempotency.Config{Mode: idempotency.Leased}, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		id := r.Header.Get("X-User") + " " + idempotency.ClientKey(r.Context())
		seen[id] = append(seen[id], idempotency.Key(r.Context()))
		mu.Unlock()
		if idempotency.FenceToken(r.Context()) <= 0 {
			t.Errorf("a Leased request's FenceToken(ctx) = %d, want > 0", idempotency.FenceToken(r.Context()))
		}
		w.WriteHeader(http.StatusServiceUnavailable) // released: the retry runs again
	})
	for _, user := range []string{"alice", "bob"} {
		for _, key := range []string{"order-1", long} {
			for range 2 {
				send(t, srv, request{key: key, user: user, body: "{}"})
			}
		}
	}
	fenceKeys := map[string][]string{}
	for _, ns := range []string{"alice", "payments"} {
		f := newFence(t, b, idempotency.FenceConfig{Namespace: ns})
		for range 2 {
			_, _ = f.Do(context.Background(), "order-1", func(ctx context.Context) ([]byte, error) {
				if idempotency.ClientKey(ctx) != "order-1" {
					t.Errorf("fence ClientKey(ctx) = %q", idempotency.ClientKey(ctx))
				}
				fenceKeys[ns] = append(fenceKeys[ns], idempotency.Key(ctx))
				return nil, errors.New("failed: released, the retry runs again")
			})
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for id, ks := range fenceKeys {
		seen["fence "+id] = ks
	}
	distinct := map[string]string{}
	for id, ks := range seen {
		if len(ks) != 2 || ks[0] != ks[1] {
			t.Errorf("%s: Key(ctx) over two runs: %q, want one key, the same on the retry", id, ks)
			continue
		}
		if len(ks[0]) > 255 || ks[0] == "" {
			t.Errorf("%s: Key(ctx) %q is %d bytes", id, ks[0], len(ks[0]))
		}
		if other, dup := distinct[ks[0]]; dup {
			t.Errorf("%s and %s share Key(ctx) %q", id, other, ks[0])
		}
		distinct[ks[0]] = id
	}
	if len(seen) != 6 {
		t.Errorf("runs seen: %v", seen)
	}
	if idempotency.Key(context.Background()) != "" || idempotency.ClientKey(context.Background()) != "" {
		t.Error("Key or ClientKey outside a run is not empty")
	}
}
