package idempotency_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/idempotency"
)

// helper 98: README: after a Leased request dies, "only the same request
// (same fingerprint) takes such a key over: another body under it gets 422
// until the key's Window ends, since the dead request's effect may have
// happened under that key". When the same request's retry takes the key
// over and its handler answers 5xx (the downstream, which saw the key
// before, failed or timed out), the 5xx release DELETEs the record, and with
// it the memory of the dead request's claim: another body under the key then
// runs the handler, against a downstream that already used the key.
func TestLeasedDeadKeyRetriedWith5xxStillRefusesAnotherBody(t *testing.T) {
	t.Parallel()
	b := setup(t)
	startAndKill(t, b, "leased", "k-dead") // the first request, body "{}", killed after its effect
	var otherRuns atomic.Int64
	srv := newServer(t, b, idempotency.Config{Mode: idempotency.Leased}, func(w http.ResponseWriter, r *http.Request) {
		buf := make([]byte, 64)
		n, _ := r.Body.Read(buf)
		if string(buf[:n]) == "{}" {
			http.Error(w, "gateway timeout", http.StatusBadGateway) // the retry of the dead request
			return
		}
		otherRuns.Add(1)
		w.WriteHeader(http.StatusCreated)
	})
	table := pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()
	waitFor(t, 20*time.Second, "the dead claim's lease to lapse", func() bool {
		var lapsed bool
		_ = b.pool.QueryRow(context.Background(), `SELECT lease_until < now() FROM `+table+` WHERE key = 'k-dead'`).Scan(&lapsed)
		return lapsed
	})
	other := request{key: "k-dead", body: `{"amount_cents":99999}`}
	if r := send(t, srv, other); r.status != http.StatusUnprocessableEntity {
		t.Fatalf("other body after the lapse: %d, want 422", r.status)
	}
	if r := send(t, srv, request{key: "k-dead", body: "{}"}); r.status != http.StatusBadGateway {
		t.Fatalf("same request's retry: %d, want the handler's 502", r.status)
	}
	r := send(t, srv, other)
	if r.status != http.StatusUnprocessableEntity || otherRuns.Load() != 0 {
		t.Fatalf("other body after the dead request's retry answered 502: %d, handler ran %d times for it; "+
			"want 422 and 0 runs (the dead request's effect may have happened under this key; its window has not ended)",
			r.status, otherRuns.Load())
	}
	// The same request may still retry at once: the 502 lapsed its claim.
	if r := send(t, srv, request{key: "k-dead", body: "{}"}); r.status != http.StatusBadGateway {
		t.Fatalf("same request's second retry: %d, want the handler's 502 again (not 409: its claim was given up)", r.status)
	}
}

// helper 112: the same hazard on a request's first attempt. A Leased
// handler called the downstream with Key(ctx), and failed: the downstream
// charged but its answer timed out (502), the handler panicked, or the
// client left mid-call (503, nothing written). Its effect may have happened
// under the key, yet the failure deleted the record: another body under
// the key then ran, and the downstream answered it with the first one's
// outcome (or refused its parameters). The failure must keep the key for
// the same request only: it may retry at once, another body gets 422.
func TestLeasedFailedFirstAttemptRefusesAnotherBody(t *testing.T) {
	t.Parallel()
	for _, failure := range []string{"502", "panic", "client left"} {
		t.Run(failure, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			var sameRuns, otherRuns atomic.Int64
			srv := newServer(t, b, idempotency.Config{Mode: idempotency.Leased}, func(w http.ResponseWriter, r *http.Request) {
				body, _ := io.ReadAll(r.Body)
				if string(body) != "{}" {
					otherRuns.Add(1)
					w.WriteHeader(http.StatusCreated)
					return
				}
				if sameRuns.Add(1) > 1 {
					w.WriteHeader(http.StatusCreated) // the retry: the downstream answers this time
					return
				}
				switch failure { // the downstream was called with Key(ctx) first
				case "502":
					http.Error(w, "gateway timeout", http.StatusBadGateway)
				case "panic":
					panic(http.ErrAbortHandler)
				case "client left":
					<-r.Context().Done()
				}
			})
			first := request{key: "k", body: "{}"}
			if failure == "client left" {
				ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
				defer cancel()
				hr, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader("{}"))
				if err != nil {
					t.Fatal(err)
				}
				hr.Header.Set(idempotency.KeyHeader, "k")
				hr.Header.Set("X-User", "alice")
				if resp, err := http.DefaultClient.Do(hr); err == nil {
					resp.Body.Close()
					t.Fatalf("first: answered %d, want the client gone", resp.StatusCode)
				}
			} else {
				_, _ = trySend(srv.URL, first)
			}
			table := pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()
			waitFor(t, 10*time.Second, "the first attempt to give up its claim", func() bool {
				var held int
				_ = b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+table+` WHERE key = 'k' AND lease_until > now()`).Scan(&held)
				return held == 0
			})
			if r := send(t, srv, request{key: "k", body: `{"amount_cents":99999}`}); r.status != http.StatusUnprocessableEntity || otherRuns.Load() != 0 {
				t.Fatalf("another body after the first attempt's %s: %d, handler ran %d times for it; want 422 and 0 runs "+
					"(the first attempt's effect may have happened under this key)", failure, r.status, otherRuns.Load())
			}
			if r := send(t, srv, first); r.status != http.StatusCreated || r.replayed {
				t.Fatalf("the same request's retry: %d replayed=%v, want a fresh 201 (its claim was given up)", r.status, r.replayed)
			}
		})
	}
}
