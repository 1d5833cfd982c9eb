package pgbouncertest_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/pgbouncertest"
	"github.com/onceflow/onceflow/relay"
)

// TestRelayRefusesAnUnreadableDateStyleBehindPgBouncer: behind PgBouncer in
// transaction mode, with the exec mode it needs, a client whose DateStyle
// is German (a start-up parameter PgBouncer applies to every server
// connection it lends the client) gets timestamps pgx cannot read. The
// relay retried the failing lease rounds forever; it must refuse at start
// naming the setting and the remedy.
func TestRelayRefusesAnUnreadableDateStyleBehindPgBouncer(t *testing.T) {
	e := pgbouncertest.Start(t)
	_, _, _, _, r := relayBehind(t, e.TransactionURL+"&default_query_exec_mode=exec&DateStyle=German", 0)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := r.Run(ctx)
	if !errors.Is(err, relay.ErrTextResultSettings) || !strings.Contains(err.Error(), `DateStyle is "German, DMY"`) ||
		!strings.Contains(err.Error(), `ALTER ROLE "postgres" SET DateStyle = 'ISO, MDY'`) {
		t.Fatalf("relay.Run returned %v (ctx %v), want relay.ErrTextResultSettings naming DateStyle and the remedy", err, ctx.Err())
	}
	t.Log(err)
}
