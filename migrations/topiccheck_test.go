package migrations_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// linearTopicCheckVersion is the migration that states version 8's topic
// rule without a bounded repetition.
const linearTopicCheckVersion = 11

// Migration 11 rewrites the topic check for cost only: every name must get
// the answer version 8's check gave it, at the lengths around 249, for
// every ASCII character and a few others, and for the dots.
func TestTheLinearTopicCheckRefusesWhatVersion8Refused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	before := pgtest.EmptySchema(t)
	upTo(t, before, linearTopicCheckVersion-1)
	after := pgtest.EmptySchema(t)
	upTo(t, after, linearTopicCheckVersion)

	names := []string{"", ".", "..", "...", "-", "_", "a", "orders", "Orders_v2.eu-west-1",
		"orders\n", "\norders", "ord ers", "café", "注文", "orders\u00a0", "a.b..c"}
	for c := rune(1); c < 0x80; c++ {
		names = append(names, string(c), "x"+string(c), string(c)+"x")
	}
	for _, n := range []int{248, 249, 250, 251, 300} {
		names = append(names, strings.Repeat("t", n), strings.Repeat("t", n-1)+"é", strings.Repeat(".", n))
	}
	accepts := func(schema, name string) bool {
		_, err := pool.Exec(ctx, `SELECT $1::text::`+pgx.Identifier{schema, "outbox_topic"}.Sanitize(), name)
		var pgErr *pgconn.PgError
		if err != nil && !(errors.As(err, &pgErr) && pgErr.Code == "23514") {
			t.Fatalf("%.20q: %v", name, err)
		}
		return err == nil
	}
	accepted, refused := 0, 0
	for _, name := range names {
		was, is := accepts(before, name), accepts(after, name)
		if was != is {
			t.Errorf("topic %.40q (%d bytes): version 10 accepted it %v, version 11 %v", name, len(name), was, is)
		}
		if is {
			accepted++
		} else {
			refused++
		}
	}
	if accepted < 60 || refused < 100 {
		t.Fatalf("%d names accepted and %d refused: the corpus does not reach both sides", accepted, refused)
	}

	if _, err := migrations.Down(ctx, pool, after, 1); err != nil {
		t.Fatal(err)
	}
	if got, want := describeOutbox(t, after), describeOutbox(t, before); got != want {
		t.Fatalf("after reverting migration 11:\n%s\nwant version 10's:\n%s", got, want)
	}
}
