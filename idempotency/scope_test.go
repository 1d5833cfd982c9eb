package idempotency_test

import (
	"net/http"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/idempotency"
)

func TestScopeIsRequired(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for name, cfg := range map[string]*idempotency.Config{"nil config": nil, "no scope": {Schema: b.schema}} {
		if _, err := idempotency.New(b.pool, cfg); err == nil || !strings.Contains(err.Error(), "Config.Scope") {
			t.Errorf("%s: New = %v, want an error naming Config.Scope", name, err)
		}
	}
}

func TestSharedScopeIsOneScopeForEveryCaller(t *testing.T) {
	t.Parallel()
	b := setup(t)
	srv := newServer(t, b, idempotency.Config{Scope: idempotency.SharedScope}, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("answer for " + r.Header.Get("X-User")))
	})
	alice := send(t, srv, request{key: "same", user: "alice", body: "{}"})
	bob := send(t, srv, request{key: "same", user: "bob", body: "{}"})
	if alice.replayed || !bob.replayed || bob.body != "answer for alice" {
		t.Fatalf("alice %+v, bob %+v: want bob to get alice's stored answer under the shared scope", alice, bob)
	}
}
