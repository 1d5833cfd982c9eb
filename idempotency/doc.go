// Package idempotency makes retried requests and re-run work safe: an HTTP
// middleware for the Idempotency-Key header, and a run-once fence (Do) for
// code that is not HTTP. Both keep their records in onceflow's
// idempotency_keys table (migrations 0002).
//
// # HTTP
//
// Wrap the routes that change state. The first request with a key claims it
// and runs the handler; its status, headers and body are stored. A retry gets
// the stored response with "Idempotent-Replayed: true"; any request with the
// key while the first still runs gets 409 with Retry-After, as a request still
// being processed (a Transactional claim in progress is not yet visible, so
// both modes wait for the first to finish before comparing requests); the key
// with a different request (method, path, body) then gets 422; no key gets
// 400. Keys are scoped by Config.Scope, the authenticated principal, so one
// client can never replay another's response. Scope is required: New fails
// without it. Only a service whose callers are all one trusted party may
// choose SharedScope instead, which lets any caller replay any other's
// responses.
//
//	mw, err := idempotency.New(pool, &idempotency.Config{
//		Scope: func(r *http.Request) (string, error) { return userFrom(r) },
//	})
//	http.Handle("POST /orders", mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
//		tx := idempotency.Tx(r.Context()) // commits with the stored response
//		_, err := tx.Exec(r.Context(), `INSERT INTO orders …`)
//		…
//	})))
//
// In Transactional mode (the default) the claim, the handler's writes through
// Tx and the stored response commit in one transaction: a crash or a 5xx at
// any point leaves no claim and no business row, and a retry runs afresh.
// In Leased mode the claim commits first with a lease, renewed while the
// handler runs (a held lease is never taken over, whatever Window says; if
// renewals fail, the request's context is cancelled before the lease lapses;
// a handler whose context ended and that wrote nothing is answered 503, with
// nothing stored and the key released); use it for handlers whose effects
// leave the database, and pass Key(ctx) to the downstream service: it is
// derived from the scope and the client's key, so two principals' same key
// never meet downstream, and it is the same on every retry (ClientKey(ctx)
// is the key as sent, which Key(ctx) used to return). A request that dies holds its key
// until the lease lapses, then a retry runs the handler again: the
// downstream's own deduplication on the key is what makes that harmless.
// A response whose store fails (a database blip) is stored again, backing
// off, for up to a lease before the client is answered.
// Only the same request does (same fingerprint): another one under that key
// gets 422 until the key's Window ends.
//
// 5xx responses and panics release the key (Config.StoreServerErrors stores
// 5xx instead; in Transactional mode their writes through Tx roll back
// either way); 4xx responses are stored. In Leased mode a 5xx, a panic or
// a 503 for a client gone releases the key to the same request only: its
// handler may have called the downstream under Key(ctx) before it failed,
// so another request under the key gets 422 until the key's Window ends. Responses larger than
// Config.MaxResponseBytes reach the client but are not stored: a retry gets
// 422 (ErrNotStored), never a second run. Memory holds at most
// MaxResponseBytes of a response; in Transactional mode the rest waits in a
// temporary file until the commit.
//
// Config.Hook is told each request's Outcome (claimed, replayed, conflict,
// mismatch, not stored) with the request's context, so a tracing adapter can
// record it on the request's span.
//
// The replay path costs one database round trip and takes no row lock (a
// SELECT in Transactional mode, the claim's INSERT … ON CONFLICT DO NOTHING
// in Leased mode); a first
// request costs five in Transactional mode (lookup, BEGIN, claim, store,
// COMMIT) and two in Leased mode (claim, store), plus the handler's own.
//
// # Run once
//
// Fence.Do (or Do with defaults) runs a function at most once per key while
// the key's record lives, returns the stored result to later callers and
// ErrInProgress to concurrent ones, and lets an expired lease be taken over:
//
//	receipt, err := idempotency.Do(ctx, pool, "charge:"+orderID, func(ctx context.Context) ([]byte, error) {
//		return gateway.Charge(ctx, orderID, idempotency.Key(ctx)) // the gateway dedups on the key too (scoped by the namespace)
//	})
//
// Pass a *pgxpool.Pool, in a consumer handler too: the claim commits on its
// own, so a rollback of the handler's transaction and the redelivery it
// causes do not run fn again. A pgx.Tx or a single connection is refused
// (see DB).
//
// Do cannot make an outside effect and its stored result atomic: if the
// process dies after the effect and before the store, the next call after the
// lease runs fn again. It makes re-runs rare and serial; the key passed
// downstream makes them harmless. If lease renewals fail, fn's context is
// cancelled before the lease lapses: an fn that honours its context does
// not run concurrently with another run of the key while its process runs.
// A process paused past its lease (stopped, a frozen VM) is cancelled by
// nothing and may resume while a later run is under way; pass
// FenceToken(ctx) downstream too, and let it refuse a token lower than the
// highest it has seen for the key (the later run's is greater). Leased
// requests have one too.
//
// # Retention
//
// Records live for Window (default 24 h) from their claim; after that the key
// may run again. A Purger deletes expired records in small batches:
//
//	p, _ := idempotency.NewPurger(pool, nil)
//	go p.Run(ctx)
//
// Middleware, Fence and Purger are safe for concurrent use.
package idempotency
