package idempotency_test

// Edge cases a cold review (helper 56) found failing: each failed on the code before its fix.

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/idempotency"
)

// a Leased claim whose holder died is taken over by a request with a
// DIFFERENT body under the same key. The first run's side effect may have
// happened (that is why Leased exists), so the new body runs under a key the
// downstream already used: the downstream dedups on the key and answers the
// first body's result, which is then stored for the second body. The docs
// promise 422 for "same key, different body".
func TestLeasedTakeoverOfADeadClaimIgnoresTheFingerprint(t *testing.T) {
	t.Parallel()
	b := setup(t)
	startAndKill(t, b, "leased", "k-dead") // first request: body "{}", killed in the handler
	var runs atomic.Int64
	srv := newServer(t, b, idempotency.Config{Mode: idempotency.Leased}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})
	other := request{key: "k-dead", body: `{"amount_cents":99999}`}
	// While its lease holds, a dead claim is a request in progress, and
	// any request under its key is answered 409 (helper 78's defect 5:
	// both modes answer a key in flight alike); 422 once it has lapsed.
	if r := send(t, srv, other); r.status != http.StatusConflict {
		t.Fatalf("different body while the dead claim's lease holds: %d, want 409", r.status)
	}
	table := pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()
	waitFor(t, 20*time.Second, "the dead claim's lease to lapse", func() bool {
		var lapsed bool
		_ = b.pool.QueryRow(context.Background(), `SELECT lease_until < now() FROM `+table+` WHERE key = 'k-dead'`).Scan(&lapsed)
		return lapsed
	})
	r := send(t, srv, other)
	if r.status != http.StatusUnprocessableEntity || runs.Load() != 0 {
		t.Fatalf("different body after the dead claim's lease lapsed: %d, handler ran %d times; want 422 and 0 runs "+
			"(the first body's effect may have happened under this key)", r.status, runs.Load())
	}
}

// a Config.Fingerprint returning nil (e.g. "don't fingerprint") makes
// every keyed request a 500: nil []byte is sent as NULL into the NOT NULL
// fingerprint column. The package itself treats a nil fingerprint as "skip
// the comparison" (record.check).
func TestNilFingerprintBreaksEveryKeyedRequest(t *testing.T) {
	t.Parallel()
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			srv := newServer(t, b, idempotency.Config{Mode: mode,
				Fingerprint: func(*http.Request, []byte) []byte { return nil }},
				func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) })
			if r := send(t, srv, request{key: "k", body: "{}"}); r.status != http.StatusCreated {
				t.Fatalf("first request with a nil fingerprint: %d %q, want 201", r.status, r.body)
			}
		})
	}
}

// serveDirect runs one request through m without an HTTP client, so any
// header bytes reach the recorder as the handler wrote them.
func serveDirect(h http.Handler, key string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader("{}"))
	req.Header.Set(idempotency.KeyHeader, key)
	req.Header.Set("X-User", "alice")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

// headers are stored as JSON text in jsonb, so a header value that is
// not UTF-8 (obs-text, e.g. a Latin-1 filename) is replayed altered
// (each bad byte becomes U+FFFD).
func TestReplayedHeaderBytesAreExact(t *testing.T) {
	t.Parallel()
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			const cd = "attachment; filename=\"caf\xe9.pdf\""
			h := newMiddleware(t, b, idempotency.Config{Mode: mode}).Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Disposition", cd)
				w.WriteHeader(http.StatusCreated)
			}))
			first := serveDirect(h, "k")
			again := serveDirect(h, "k")
			if first.Code != http.StatusCreated || again.Header().Get(idempotency.ReplayedHeader) != "true" {
				t.Fatalf("first %d, retry %d replayed=%q", first.Code, again.Code, again.Header().Get(idempotency.ReplayedHeader))
			}
			if got := again.Header().Get("Content-Disposition"); got != cd {
				t.Fatalf("replayed Content-Disposition %q, first was %q", got, cd)
			}
		})
	}
}

// a header value holding a NUL byte cannot be stored (jsonb refuses
// \u0000). In Leased mode the handler's effect happened, the store fails,
// the key stays "running" until its lease lapses, and the next retry runs
// the handler again: the same deterministic failure, once per lease.
func TestLeasedHeaderThatCannotBeStoredRunsTheHandlerAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var runs atomic.Int64
	h := newMiddleware(t, b, idempotency.Config{Mode: idempotency.Leased, Lease: time.Second}).Handler(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1) // the charge
			w.Header().Set("X-Trace", "a\x00b")
			w.WriteHeader(http.StatusCreated)
		}))
	if r := serveDirect(h, "k"); r.Code != http.StatusCreated {
		t.Fatalf("first: %d", r.Code)
	}
	var last *httptest.ResponseRecorder
	waitFor(t, 10*time.Second, "the retry to stop answering 409", func() bool {
		last = serveDirect(h, "k")
		return last.Code != http.StatusConflict
	})
	if runs.Load() != 1 {
		t.Fatalf("handler ran %d times for one key (retry answered %d); want 1", runs.Load(), last.Code)
	}
}

// a result finished after its Window (allowed: Window may equal Lease,
// and a renewed lease holds however long fn runs) is stored already expired,
// so the very next call runs fn again.
func TestResultFinishedPastTheWindowIsReplayed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	f := newFence(t, b, idempotency.FenceConfig{Lease: time.Second, Window: time.Second})
	var runs atomic.Int64
	fn := func(ctx context.Context) ([]byte, error) {
		if runs.Add(1) == 1 {
			time.Sleep(1500 * time.Millisecond) // lease renewed meanwhile
		}
		return []byte("receipt"), nil
	}
	if _, err := f.Do(context.Background(), "charge", fn); err != nil {
		t.Fatal(err)
	}
	got, err := f.Do(context.Background(), "charge", fn)
	if err != nil || string(got) != "receipt" || runs.Load() != 1 {
		t.Fatalf("call right after the first finished: %q, %v; fn ran %d times, want 1", got, err, runs.Load())
	}
}

// fn ending its goroutine (runtime.Goexit, e.g. t.FailNow or
// log-and-Goexit helpers) skips stop(): the renewal goroutine runs forever
// and the key is "running" with a live lease forever.
func TestDoGoexitLeavesTheKeyHeldForever(t *testing.T) {
	t.Parallel()
	b := setup(t)
	f := newFence(t, b, idempotency.FenceConfig{Lease: 300 * time.Millisecond, Window: time.Second})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = f.Do(context.Background(), "k", func(context.Context) ([]byte, error) {
			runtime.Goexit()
			return nil, nil
		})
	}()
	<-done
	time.Sleep(1200 * time.Millisecond) // 4 leases
	_, err := f.Do(context.Background(), "k", func(context.Context) ([]byte, error) { return []byte("ok"), nil })
	if errors.Is(err, idempotency.ErrInProgress) {
		t.Fatalf("4 leases after the caller's goroutine ended, the key is still in progress: %v", err)
	}
}

// Window is checked against Lease in Transactional mode too, where no
// lease exists: Window 30s is refused because of the default Lease (1m)
// the user never set and that does not apply.
func TestTransactionalWindowNotTiedToLease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if _, err := idempotency.New(b.pool, &idempotency.Config{Scope: idempotency.SharedScope, Window: 30 * time.Second}); err != nil {
		t.Fatalf("Transactional middleware with Window 30s: %v", err)
	}
}

// the handler writes into a fresh header map, and the middleware then
// overwrites the real writer's header of the same name: a header an outer
// middleware set (CORS's "Vary: Origin") is lost when the handler adds to it.
func TestOuterHeadersSurviveAHandlerAddingToThem(t *testing.T) {
	t.Parallel()
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			inner := newMiddleware(t, b, idempotency.Config{Mode: mode}).Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Add("Vary", "Accept-Encoding")
				w.WriteHeader(http.StatusCreated)
			}))
			outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Add("Vary", "Origin") // what a CORS middleware does
				inner.ServeHTTP(w, r)
			})
			r := serveDirect(outer, "k")
			if got := r.Header().Values("Vary"); len(got) != 2 {
				t.Fatalf("Vary = %q, want [Origin Accept-Encoding]", got)
			}
		})
	}
}

// a key longer than the index allows (MaxKeyLength raised) answers 500,
// not 400; Fence.Do maps the same error to ErrKeyInvalid.
func TestMiddlewareKeyTooLongForTheIndexIs400(t *testing.T) {
	t.Parallel()
	b := setup(t)
	srv := newServer(t, b, idempotency.Config{MaxKeyLength: 8000},
		func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) })
	var sb strings.Builder
	x := uint32(12345)
	for sb.Len() < 6000 { // incompressible printable ASCII
		x = x*1664525 + 1013904223
		sb.WriteByte(byte(0x21 + (x>>24)%94))
	}
	if r := send(t, srv, request{key: sb.String(), body: "{}"}); r.status != http.StatusBadRequest {
		t.Fatalf("6000-byte key (MaxKeyLength 8000): %d %q, want 400", r.status, r.body)
	}
}

// a key PostgreSQL text cannot hold (NUL, invalid UTF-8; Kafka message
// ids can be arbitrary bytes) is a generic database error on every call,
// not ErrKeyInvalid as for a key too long for the index.
func TestDoRefusesAKeyTextCannotHoldAsInvalid(t *testing.T) {
	t.Parallel()
	b := setup(t)
	f := newFence(t, b, idempotency.FenceConfig{})
	for _, key := range []string{"a\x00b", "caf\xe9"} {
		_, err := f.Do(context.Background(), key, func(context.Context) ([]byte, error) { return nil, nil })
		if !errors.Is(err, idempotency.ErrKeyInvalid) {
			t.Errorf("Do(%q): %v, want ErrKeyInvalid", key, err)
		}
	}
}

// An upstream header the handler deleted is deleted from the replay too
// (a cold review, helper 59: the deletion was not stored, and a replay
// carried a shared-cache directive the first, private, answer had not).
func TestReplayKeepsAHeaderTheHandlerDeleted(t *testing.T) {
	t.Parallel()
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			inner := newMiddleware(t, b, idempotency.Config{Mode: mode}).Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Del("Cache-Control") // a private answer: no site-wide public caching
				w.WriteHeader(http.StatusCreated)
			}))
			outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Cache-Control", "public, max-age=300") // a site-wide default
				inner.ServeHTTP(w, r)
			})
			first := serveDirect(outer, "k")
			again := serveDirect(outer, "k")
			if again.Header().Get(idempotency.ReplayedHeader) != "true" {
				t.Fatalf("not replayed: %d", again.Code)
			}
			if got := first.Header().Get("Cache-Control"); got != "" {
				t.Fatalf("first response Cache-Control %q, want none", got)
			}
			if got := again.Header().Get("Cache-Control"); got != "" {
				t.Errorf("replay has Cache-Control %q; the first response had none (the handler deleted it)", got)
			}
		})
	}
}

// A header name net/http would not send (one beginning with a blank, as
// the stored encoding's marker does, or not UTF-8) is not stored either,
// and the key replays (a cold review, helper 59: a handler's header named
// like the marker made every retry of its key a 500 for the whole Window,
// and a name that is not UTF-8 came back altered).
func TestHeaderNamesNetHTTPWouldNotSendAreNotStored(t *testing.T) {
	t.Parallel()
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			h := newMiddleware(t, b, idempotency.Config{Mode: mode}).Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header()[" base64 X-Note"] = []string{"hello world"}
				w.Header()["X-Caf\xe9"] = []string{"v"}
				w.Header().Set("X-Ok", "kept")
				w.WriteHeader(http.StatusCreated)
			}))
			if first := serveDirect(h, "k"); first.Code != http.StatusCreated {
				t.Fatalf("first %d", first.Code)
			}
			again := serveDirect(h, "k")
			if again.Code != http.StatusCreated || again.Header().Get(idempotency.ReplayedHeader) != "true" {
				t.Fatalf("retry answered %d %q, want the stored 201 replayed", again.Code, again.Body.String())
			}
			if again.Header().Get("X-Ok") != "kept" {
				t.Errorf("replayed headers %q lack X-Ok", again.Header())
			}
			for _, name := range []string{" base64 X-Note", "X-Caf\xe9"} {
				if _, ok := again.Header()[name]; ok {
					t.Errorf("replayed header %q, which net/http does not send", name)
				}
			}
		})
	}
}
