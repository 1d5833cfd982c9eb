package relay_test

import (
	"context"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/relay"
)

// A relay on a schema that lacks a migration it needs refuses to start and
// names the missing migration, even though the outbox table is there.
func TestRunNamesTheMissingMigration(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	if _, err := migrations.Down(ctx, b.pool, b.schema, 1); err != nil {
		t.Fatal(err)
	}
	all, _ := migrations.All()
	last := all[len(all)-1]
	pub := b.publisher(t)
	defer pub.Close()
	r, err := relay.New(b.pool, pub, &relay.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	err = r.Run(ctx)
	if err == nil || !strings.Contains(err.Error(), last.Name) || !strings.Contains(err.Error(), "migrate up") {
		t.Fatalf("Run on a schema without %04d_%s: err %v", last.Version, last.Name, err)
	}
	_ = pgtest.Pool(t)
}
