package consumer_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
	"github.com/onceflow/onceflow/internal/pgtest"
)

// TestAConsumerWithoutItsGrantSaysSoAndGoesOnOnceGranted: a role without
// INSERT on processed_messages (a grant forgotten at deploy) fails every
// message alike. The consumer waits on its partition as README's "Roles
// and privileges" says, spending no budget and dead-lettering nothing, but
// it logged each wait at Warn as "database unavailable", sending the
// operator to look for an outage. It now logs at Error that the role lacks
// a privilege, naming README's section, and goes on once granted.
func TestAConsumerWithoutItsGrantSaysSoAndGoesOnOnceGranted(t *testing.T) {
	inBothModes(t, func(t *testing.T, batch bool) {
		b := setup(t)
		ctx := context.Background()
		pool := pgtest.RolePool(t, b.schema,
			`GRANT USAGE ON SCHEMA {s} TO {role}`,
			`GRANT SELECT ON {s}.processed_messages TO {role}`, // no INSERT
			`GRANT INSERT ON {s}.effects TO {role}`)
		logs := &syncBuffer{}
		p := newLedgerProcessor(t, pool, batch, func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
			return b.record(ctx, tx, "ledger", m)
		}, &consumer.Config{Schema: b.schema, MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
			Logger: slog.New(slog.NewTextHandler(logs, nil))})
		tr := &memTransport{}
		w := start(t, p, tr, msg(0, "id-0", "k"), msg(1, "id-1", "k"))
		defer w.Stop(ctx)
		// The batch's fallback logs the refusal first, at Warn; wait for the
		// message's own retry.
		waitFor(t, 10*time.Second, "the refusal logged as a missing privilege", func() bool { return strings.Contains(logs.String(), "lacks a privilege") })
		out := logs.String()
		if !strings.Contains(out, "level=ERROR") || !strings.Contains(out, "lacks a privilege") || !strings.Contains(out, "Roles and privileges") {
			t.Fatalf("the refusal was not logged at Error as a missing privilege naming README's section; logs:\n%s", firstLines(out, 5))
		}
		if strings.Contains(out, "database unavailable") {
			t.Fatalf("a refused grant was logged as the database being unavailable; logs:\n%s", firstLines(out, 5))
		}
		if got := tr.lastMark(); got != -1 {
			t.Fatalf("offset %d marked done while the role may not record messages", got)
		}
		if _, err := b.pool.Exec(ctx, `GRANT INSERT ON `+pgx.Identifier{b.schema, "processed_messages"}.Sanitize()+` TO `+pool.Config().ConnConfig.User); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, "both messages marked done once granted", func() bool { return tr.lastMark() == 1 })
		if n := b.count(t, ""); n != 2 {
			t.Fatalf("effects = %d, want 2", n)
		}
		if d := tr.deadLetters(); len(d) != 0 {
			t.Fatalf("%d messages dead-lettered for a missing grant", len(d))
		}
	})
}

// firstLines returns s's first n lines, for a failure message.
func firstLines(s string, n int) string {
	lines := strings.SplitN(s, "\n", n+1)
	if len(lines) > n {
		lines = lines[:n]
	}
	return strings.Join(lines, "\n")
}
