package idempotency_test

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/idempotency"
)

var modes = []idempotency.Mode{idempotency.Transactional, idempotency.Leased}

// orderHandler writes one effect and answers 201 with a body naming it.
func orderHandler(b bundle, runs *atomic.Int64) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		if err := writeEffect(r.Context(), b.pool, b.schema, "order"); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/orders/o-1")
		http.SetCookie(w, &http.Cookie{Name: "session", Value: "secret"})
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(map[string]any{"order_id": "o-1", "run": n})
	}
}

func TestConcurrentIdenticalRequestsRunOnce(t *testing.T) {
	t.Parallel()
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			const n = 50
			var runs atomic.Int64
			var answered atomic.Int64
			srv := newServer(t, b, idempotency.Config{Mode: mode}, func(w http.ResponseWriter, r *http.Request) {
				// Hold the first run open until half the others have been
				// answered (409), so the rest race with its completion.
				deadline := time.Now().Add(10 * time.Second)
				for answered.Load() < n/2 && time.Now().Before(deadline) {
					time.Sleep(5 * time.Millisecond)
				}
				orderHandler(b, &runs)(w, r)
			})
			resps := make([]response, n)
			var wg sync.WaitGroup
			for i := range resps {
				wg.Add(1)
				go func() {
					defer wg.Done()
					resps[i] = send(t, srv, request{key: "k-1", body: `{"amount_cents":500}`})
					answered.Add(1)
				}()
			}
			wg.Wait()
			if got := b.effects(t); got != 1 {
				t.Fatalf("effects = %d, want exactly 1", got)
			}
			if got := runs.Load(); got != 1 {
				t.Fatalf("handler ran %d times, want 1", got)
			}
			stored := send(t, srv, request{key: "k-1", body: `{"amount_cents":500}`})
			if stored.status != http.StatusCreated || !stored.replayed {
				t.Fatalf("retry after completion: %d replayed=%v, want 201 replayed", stored.status, stored.replayed)
			}
			firsts, conflicts := 0, 0
			for _, r := range resps {
				switch {
				case r.status == http.StatusConflict:
					conflicts++
					if r.header.Get("Retry-After") == "" {
						t.Error("409 without Retry-After")
					}
				case r.status == http.StatusCreated && r.body == stored.body:
					if !r.replayed {
						firsts++
					}
				default:
					t.Errorf("response %d %q is neither the stored one nor 409", r.status, r.body)
				}
			}
			if firsts != 1 {
				t.Errorf("%d responses came from a first run, want 1", firsts)
			}
			if conflicts < n/2 {
				t.Errorf("only %d responses were 409 while the first run was held open, want at least %d", conflicts, n/2)
			}
		})
	}
}

func TestReplayReturnsStoredResponse(t *testing.T) {
	t.Parallel()
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			var runs atomic.Int64
			srv := newServer(t, b, idempotency.Config{Mode: mode}, orderHandler(b, &runs))
			req := request{key: `"k-quoted"`, body: `{"amount_cents":500}`}
			first := send(t, srv, req)
			if first.status != http.StatusCreated || first.replayed || first.header.Get("Set-Cookie") == "" {
				t.Fatalf("first: %d replayed=%v cookie=%q", first.status, first.replayed, first.header.Get("Set-Cookie"))
			}
			for range 2 {
				again := send(t, srv, req)
				if again.status != first.status || again.body != first.body || !again.replayed {
					t.Fatalf("retry: %d %q replayed=%v, want %d %q replayed", again.status, again.body, again.replayed, first.status, first.body)
				}
				if again.header.Get("Location") != "/orders/o-1" || again.header.Get("Content-Type") != "application/json" {
					t.Errorf("replayed headers lost: %v", again.header)
				}
				if again.header.Get("Set-Cookie") != "" {
					t.Errorf("replay carries Set-Cookie %q", again.header.Get("Set-Cookie"))
				}
			}
			// The draft's quoted form and the bare form name the same key.
			bare := send(t, srv, request{key: "k-quoted", body: req.body})
			if !bare.replayed {
				t.Errorf("bare form of a quoted key ran again: %d", bare.status)
			}
			if runs.Load() != 1 || b.effects(t) != 1 {
				t.Fatalf("handler ran %d times, %d effects; want 1 and 1", runs.Load(), b.effects(t))
			}
		})
	}
}

func TestRequestErrors(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var runs atomic.Int64
	srv := newServer(t, b, idempotency.Config{MaxRequestBytes: 64}, orderHandler(b, &runs))
	if r := send(t, srv, request{key: "used", body: `{"amount_cents":500}`}); r.status != http.StatusCreated {
		t.Fatalf("first use: %d", r.status)
	}
	tests := []struct {
		name string
		req  request
		want int
	}{
		{"missing key", request{body: "{}"}, http.StatusBadRequest},
		{"key too long", request{key: strings.Repeat("k", 256), body: "{}"}, http.StatusBadRequest},
		{"key not printable", request{key: "k\u00e9", body: "{}"}, http.StatusBadRequest},
		{"no principal", request{key: "k-2", user: "-", body: "{}"}, http.StatusUnauthorized},
		{"other body", request{key: "used", body: `{"amount_cents":999}`}, http.StatusUnprocessableEntity},
		{"other path", request{key: "used", path: "/refunds", body: `{"amount_cents":500}`}, http.StatusUnprocessableEntity},
		{"other method", request{key: "used", method: http.MethodPut, body: `{"amount_cents":500}`}, http.StatusUnprocessableEntity},
		{"request too large", request{key: "k-3", body: strings.Repeat("x", 65)}, http.StatusRequestEntityTooLarge},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if r := send(t, srv, tt.req); r.status != tt.want {
				t.Errorf("status %d (%q), want %d", r.status, r.body, tt.want)
			}
		})
	}
	if runs.Load() != 1 || b.effects(t) != 1 || b.records(t) != 1 {
		t.Fatalf("after refused requests: %d runs, %d effects, %d records; want 1, 1, 1", runs.Load(), b.effects(t), b.records(t))
	}
	// 255 bytes is the longest key accepted.
	if r := send(t, srv, request{key: strings.Repeat("k", 255), body: "{}"}); r.status != http.StatusCreated {
		t.Errorf("255-byte key: %d", r.status)
	}
}

func TestOptionalKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var runs atomic.Int64
	srv := newServer(t, b, idempotency.Config{KeyOptional: true}, orderHandler(b, &runs))
	for range 2 {
		if r := send(t, srv, request{body: "{}"}); r.status != http.StatusCreated || r.replayed {
			t.Fatalf("without key: %d replayed=%v", r.status, r.replayed)
		}
	}
	if b.effects(t) != 2 || b.records(t) != 0 {
		t.Fatalf("%d effects, %d records; want 2 (committed through the transaction) and 0", b.effects(t), b.records(t))
	}
}

func TestScopesAreIndependent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	srv := newServer(t, b, idempotency.Config{}, func(w http.ResponseWriter, r *http.Request) {
		if err := writeEffect(r.Context(), b.pool, b.schema, r.Header.Get("X-User")); err != nil {
			t.Error(err)
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("secret of " + r.Header.Get("X-User")))
	})
	alice := send(t, srv, request{key: "same", user: "alice", body: "{}"})
	bob := send(t, srv, request{key: "same", user: "bob", body: "{}"})
	if alice.replayed || bob.replayed || alice.body != "secret of alice" || bob.body != "secret of bob" {
		t.Fatalf("alice %+v, bob %+v: want two independent first runs", alice, bob)
	}
	for _, user := range []string{"alice", "bob"} {
		r := send(t, srv, request{key: "same", user: user, body: "{}"})
		if !r.replayed || r.body != "secret of "+user {
			t.Errorf("%s's retry got %q replayed=%v", user, r.body, r.replayed)
		}
	}
	if b.effects(t) != 2 {
		t.Fatalf("effects = %d, want 2", b.effects(t))
	}
}

func TestOversizedResponseIsNotStoredNorRunAgain(t *testing.T) {
	t.Parallel()
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			var runs atomic.Int64
			big := strings.Repeat("x", 100)
			srv := newServer(t, b, idempotency.Config{Mode: mode, MaxResponseBytes: 10}, func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				_ = writeEffect(r.Context(), b.pool, b.schema, "big")
				_, _ = w.Write([]byte(big[:5]))
				_, _ = w.Write([]byte(big[5:]))
			})
			if r := send(t, srv, request{key: "k", body: "{}"}); r.status != http.StatusOK || r.body != big {
				t.Fatalf("first: %d, %d bytes; want 200 with all %d bytes", r.status, len(r.body), len(big))
			}
			r := send(t, srv, request{key: "k", body: "{}"})
			if r.status != http.StatusUnprocessableEntity || !strings.Contains(r.body, "too large") {
				t.Fatalf("retry: %d %q, want 422 saying the response was too large", r.status, r.body)
			}
			if runs.Load() != 1 || b.effects(t) != 1 {
				t.Fatalf("%d runs, %d effects; want 1 and 1", runs.Load(), b.effects(t))
			}
		})
	}
}

func TestServerErrorsAndPanicsReleaseTheKey(t *testing.T) {
	t.Parallel()
	for _, mode := range modes {
		for _, failure := range []string{"500", "panic"} {
			t.Run(mode.String()+"/"+failure, func(t *testing.T) {
				t.Parallel()
				b := setup(t)
				var runs atomic.Int64
				srv := newServer(t, b, idempotency.Config{Mode: mode}, func(w http.ResponseWriter, r *http.Request) {
					if runs.Add(1) == 1 {
						if mode == idempotency.Transactional {
							if err := writeEffect(r.Context(), b.pool, b.schema, "doomed"); err != nil {
								t.Error(err)
							}
						}
						if failure == "panic" {
							panic(http.ErrAbortHandler) // quiet in the server log
						}
						http.Error(w, "boom", http.StatusInternalServerError)
						return
					}
					w.WriteHeader(http.StatusCreated)
				})
				first, err := trySend(srv.URL, request{key: "k", body: "{}"})
				if failure == "500" && (err != nil || first.status != http.StatusInternalServerError) {
					t.Fatalf("first: %+v %v, want the handler's 500", first, err)
				}
				if failure == "panic" && err == nil {
					t.Fatalf("first: %+v, want the connection aborted", first)
				}
				// Transactional: the claim rolled back with the effects.
				// Leased: the claim stays, its lease lapsed, for this
				// request's retry only (TestLeasedFailedFirstAttemptRefusesAnotherBody).
				wantRecords := 0
				if mode == idempotency.Leased {
					wantRecords = 1
				}
				if b.records(t) != wantRecords || b.effects(t) != 0 {
					t.Fatalf("after the failure: %d records, %d effects; want %d and none", b.records(t), b.effects(t), wantRecords)
				}
				if r := send(t, srv, request{key: "k", body: "{}"}); r.status != http.StatusCreated || r.replayed {
					t.Fatalf("retry: %d replayed=%v, want a fresh 201", r.status, r.replayed)
				}
			})
		}
	}
}

func TestStoredClientAndServerErrors(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var runs atomic.Int64
	status := map[string]int{"/bad": http.StatusBadRequest, "/down": http.StatusServiceUnavailable}
	srv := newServer(t, b, idempotency.Config{StoreServerErrors: true}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		http.Error(w, "nope", status[r.URL.Path])
	})
	for path, want := range status {
		for i := range 2 {
			r := send(t, srv, request{key: "k" + path, path: path, body: "{}"})
			if r.status != want || r.replayed != (i == 1) {
				t.Errorf("%s try %d: %d replayed=%v, want %d replayed=%v", path, i, r.status, r.replayed, want, i == 1)
			}
		}
	}
	if runs.Load() != 2 {
		t.Fatalf("handler ran %d times, want 2", runs.Load())
	}
}

func TestLeaseIsRenewedWhileHandlerRuns(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const lease = time.Second
	release := make(chan struct{})
	started := make(chan struct{})
	srv := newServer(t, b, idempotency.Config{Mode: idempotency.Leased, Lease: lease}, func(w http.ResponseWriter, r *http.Request) {
		close(started)
		<-release
		w.WriteHeader(http.StatusCreated)
	})
	done := make(chan response)
	go func() { done <- send(t, srv, request{key: "slow", body: "{}"}) }()
	<-started
	var firstLease time.Time
	table := pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()
	if err := b.pool.QueryRow(context.Background(), `SELECT lease_until FROM `+table).Scan(&firstLease); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the database clock to pass the first lease by a whole lease", func() bool {
		var passed bool
		_ = b.pool.QueryRow(context.Background(), `SELECT now() > $1::timestamptz + $2::interval`, firstLease, lease.String()).Scan(&passed)
		return passed
	})
	if r := send(t, srv, request{key: "slow", body: "{}"}); r.status != http.StatusConflict {
		t.Fatalf("retry while a renewed lease holds: %d, want 409", r.status)
	}
	close(release)
	if r := <-done; r.status != http.StatusCreated || r.replayed {
		t.Fatalf("first: %+v", r)
	}
	if r := send(t, srv, request{key: "slow", body: "{}"}); !r.replayed {
		t.Fatalf("retry after completion: %+v, want replay", r)
	}
}

// Not parallel: it points TMPDIR where no file can be made.
func TestTransactionalResponseThatCannotBeHeldRollsBack(t *testing.T) {
	b := setup(t)
	t.Setenv("TMPDIR", t.TempDir()+"/missing")
	srv := newServer(t, b, idempotency.Config{MaxResponseBytes: 4}, func(w http.ResponseWriter, r *http.Request) {
		if err := writeEffect(r.Context(), b.pool, b.schema, "lost"); err != nil {
			t.Error(err)
		}
		_, _ = w.Write([]byte("more than four bytes"))
	})
	if r := send(t, srv, request{key: "k", body: "{}"}); r.status != http.StatusInternalServerError {
		t.Fatalf("status %d, want 500", r.status)
	}
	if b.effects(t) != 0 || b.records(t) != 0 {
		t.Fatalf("%d effects, %d records; want the transaction rolled back", b.effects(t), b.records(t))
	}
}
