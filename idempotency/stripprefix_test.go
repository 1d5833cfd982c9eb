package idempotency_test

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/onceflow/onceflow/idempotency"
)

// helper 112: one Middleware mounted under two http.StripPrefix routes
// ("/v1", "/v2") saw the same path after the prefix, so the default
// fingerprint (method, path, body) took /v2/orders for /v1/orders: a
// client reusing a key there got /v1's response replayed, and /v2's
// handler never ran. The fingerprint takes the path the client sent.
func TestDefaultFingerprintSeesThePathBeforeStripPrefix(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			m := newMiddleware(t, b, idempotency.Config{Mode: mode})
			var runs atomic.Int64
			h := m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				w.WriteHeader(http.StatusCreated)
			}))
			mux := http.NewServeMux()
			mux.Handle("/v1/", http.StripPrefix("/v1", h))
			mux.Handle("/v2/", http.StripPrefix("/v2", h))
			srv := httptest.NewServer(mux)
			defer srv.Close()
			key := "k-" + mode.String()
			if r := send(t, srv, request{key: key, path: "/v1/orders", body: "{}"}); r.status != http.StatusCreated {
				t.Fatalf("/v1/orders: %d, want 201", r.status)
			}
			r := send(t, srv, request{key: key, path: "/v2/orders", body: "{}"})
			if r.status != http.StatusUnprocessableEntity || runs.Load() != 1 {
				t.Fatalf("/v2/orders under /v1's key: %d replayed=%v, handler runs %d; want 422 (another request) and 1 run",
					r.status, r.replayed, runs.Load())
			}
		})
	}
}
