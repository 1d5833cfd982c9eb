package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/onceflow/onceflow/idempotency"
)

type spanKey struct{}

// spanHook stands in for a tracing adapter: it finds the request's "span"
// in the context the hook is given and records the outcome on it.
type spanHook struct {
	mu     sync.Mutex
	events []string
}

func (h *spanHook) OnRequest(ctx context.Context, e idempotency.RequestEvent) {
	span, _ := ctx.Value(spanKey{}).(string)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.events = append(h.events, span+" "+e.Key+" "+e.Mode.String()+" "+e.Outcome.String())
}

func (h *spanHook) take() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	ev := h.events
	h.events = nil
	return ev
}

func TestHookSeesEachRequestsOutcomeOnItsContext(t *testing.T) {
	t.Parallel()
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			hook := &spanHook{}
			started, release := make(chan struct{}), make(chan struct{})
			cfg := idempotency.Config{Schema: b.schema, Mode: mode, Scope: userScope, MaxResponseBytes: 10, Hook: hook}
			m, err := idempotency.New(b.pool, &cfg)
			if err != nil {
				t.Fatal(err)
			}
			h := m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				switch idempotency.ClientKey(r.Context()) {
				case "slow":
					close(started)
					<-release
				case "big":
					_, _ = w.Write([]byte(strings.Repeat("x", 11)))
					return
				}
				w.WriteHeader(http.StatusCreated)
			}))
			// The "tracing middleware" outside puts the request's span in
			// its context, as otelhttp does.
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), spanKey{}, "span-"+r.Header.Get("X-Span"))))
			}))
			t.Cleanup(srv.Close)
			for _, tc := range []struct {
				req  request
				want string
			}{
				{request{key: "k", body: "a"}, "claimed"},
				{request{key: "k", body: "a"}, "replayed"},
				{request{key: "k", body: "b"}, "mismatch"},
				{request{key: "big"}, "claimed"},
				{request{key: "big"}, "not_stored"},
				{request{body: "no key"}, ""},
				{request{key: "k", user: "-"}, ""},
			} {
				tc.req.header = map[string]string{"X-Span": "1"}
				send(t, srv, tc.req)
				want := []string{"span-1 " + tc.req.key + " " + mode.String() + " " + tc.want}
				if tc.want == "" {
					want = nil
				}
				if got := hook.take(); strings.Join(got, "|") != strings.Join(want, "|") {
					t.Errorf("%+v: hook saw %q, want %q", tc.req, got, want)
				}
			}
			done := make(chan response, 1)
			go func() { done <- send(t, srv, request{key: "slow", header: map[string]string{"X-Span": "2"}}) }()
			<-started
			if r := send(t, srv, request{key: "slow", header: map[string]string{"X-Span": "3"}}); r.status != http.StatusConflict {
				t.Errorf("retry while running: %d, want 409", r.status)
			}
			close(release)
			<-done
			want := []string{"span-2 slow " + mode.String() + " claimed", "span-3 slow " + mode.String() + " conflict"}
			if got := hook.take(); strings.Join(got, "|") != strings.Join(want, "|") {
				t.Errorf("hook saw %q, want %q", got, want)
			}
		})
	}
}
