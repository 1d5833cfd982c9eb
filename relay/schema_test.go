package relay_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

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

// A relay of an older release started on a schema a newer onceflow
// migrated (a rolled-back deploy, or a rolling upgrade under way) runs, but
// says so: the operator learns the schema is ahead of it, and which
// versions, before anything odd happens.
func TestRunWarnsOfMigrationsItDoesNotKnow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if _, err := b.pool.Exec(context.Background(), `INSERT INTO `+b.schema+`.schema_migrations (version, name) VALUES (9998, 'from_the_future'), (9999, 'further')`); err != nil {
		t.Fatal(err)
	}
	logger, logs := newLogger(slog.LevelInfo)
	b.startRelay(t, relay.Config{Logger: logger})
	waitFor(t, "the relay to start", 30*time.Second, func() bool { return len(logs.lines(`relay started`)) == 1 })
	warned := logs.lines(`level=WARN .*newer onceflow.*versions="?\[9998 9999\]`)
	if len(warned) != 1 {
		t.Fatalf("want one warning naming versions 9998 and 9999; logs:\n%s", logs.String())
	}
}
