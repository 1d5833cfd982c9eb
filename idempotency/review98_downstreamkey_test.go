package idempotency_test

import (
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
// deduplicate too". But Key(ctx) is the client's bare key, without its
// scope: two principals who both send "order-1" (clients pick keys
// independently: counters, their own order ids) reach the downstream with
// one key. A payment gateway deduplicating on the key, as Stripe does per
// account, answers the second principal with the first one's charge: Bob is
// told he paid with Alice's charge and nobody charges Bob.
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
