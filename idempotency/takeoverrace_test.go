package idempotency

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
)

// racer passes a claimer's statements to its querier, and runs other once,
// right after the claimer's first statement (the claim that reads the
// record in its way) has been read: another claimer's move landing between
// that read and whatever the first claimer does next.
type racer struct {
	querier
	once  sync.Once
	other func()
}

func (q *racer) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return racedRow{q.querier.QueryRow(ctx, sql, args...), q}
}

type racedRow struct {
	pgx.Row
	q *racer
}

func (r racedRow) Scan(dest ...any) error {
	err := r.Row.Scan(dest...)
	r.q.once.Do(r.q.other)
	return err
}

// A Leased key whose holder died (request D, lease lapsed) is claimed by
// two callers at once, X and Y. Y's claim lands right after X read the dead
// record (or before, yFirst): Y takes the key over and runs, and X must be
// answered from the record as it is when X decides.
//
// Before the fix, X, having lost the takeover to Y, was answered from the
// dead holder's record it had read before: 422 ("key used for a different
// request") whenever its request differed from D's, although the key was
// now Y's running claim (of X's very own request, even) and a key in
// flight answers 409 in both modes.
func TestLostTakeoverIsAnsweredFromTheRecordThatWon(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		expired bool   // the dead holder's record has expired too
		x, y    string // the requests' fingerprints; the dead holder's is "D"
		yFirst  bool   // Y's claim lands before X reads the record
		want    error  // X's answer
	}{
		// An expired record is anyone's: Y takes it over, and X finds
		// Y's claim running.
		{name: "expired/same request", expired: true, x: "F", y: "F", want: ErrInProgress},
		{name: "expired/other requests", expired: true, x: "F", y: "G", want: ErrInProgress},
		// A lapsed one only the dead holder's request takes over.
		{name: "lapsed/holder's request", x: "D", y: "D", want: ErrInProgress},
		{name: "lapsed/other request after the holder's retry", x: "F", y: "D", yFirst: true, want: ErrInProgress},
		// X read the dead holder's record, which X's request may not take
		// over, before Y's retry of it claimed the key: X is answered as
		// if it came before Y, without a takeover (and any retry of X
		// gets 422 too, once Y is done).
		{name: "lapsed/other request before the holder's retry", x: "F", y: "D", want: ErrMismatch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			schema := pgtest.Schema(t)
			pool := pgtest.Pool(t)
			st, err := newStore(schema)
			if err != nil {
				t.Fatal(err)
			}
			expires := "now() + interval '1 hour'"
			if tc.expired {
				expires = "now() - interval '1 minute'"
			}
			if _, err := pool.Exec(ctx, `INSERT INTO `+st.table+` (scope, key, fingerprint, state, token, lease_until, expires_at)
VALUES ('http:u', 'k', 'D', 'running', gen_random_uuid(), now() - interval '1 hour', `+expires+`)`); err != nil {
				t.Fatal(err)
			}
			lease, window := 30*time.Second, time.Hour
			var yClaimed bool
			var yErr error
			y := func() {
				yClaimed, _, yErr = st.tryClaim(ctx, pool, &claim{scope: "http:u", key: "k", token: newToken(), fingerprint: []byte(tc.y)}, lease, window)
			}
			db := querier(pool)
			if tc.yFirst {
				y()
			} else {
				db = &racer{querier: pool, other: y}
			}
			xClaimed, rec, err := st.tryClaim(ctx, db, &claim{scope: "http:u", key: "k", token: newToken(), fingerprint: []byte(tc.x)}, lease, window)
			if err != nil || yErr != nil {
				t.Fatalf("X: %v; Y: %v", err, yErr)
			}
			if !yClaimed || xClaimed {
				t.Fatalf("Y claimed %v, X claimed %v: want Y only", yClaimed, xClaimed)
			}
			if got := rec.check([]byte(tc.x)); !errors.Is(got, tc.want) {
				var state string
				var fp []byte
				_ = pool.QueryRow(ctx, `SELECT state, fingerprint FROM `+st.table+` WHERE key = 'k'`).Scan(&state, &fp)
				t.Fatalf("X (request %s) got %v; want %v (the key is now %s, request %s; X was answered from a record of request %s, lapsed %v)",
					tc.x, got, tc.want, state, fp, rec.fingerprint, rec.lapsed)
			}
		})
	}
}
