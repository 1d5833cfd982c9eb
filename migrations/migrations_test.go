package migrations_test

import (
	"context"
	"sync"
	"testing"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

func tableExists(t *testing.T, schema, table string) bool {
	t.Helper()
	var ok bool
	err := pgtest.Pool(t).QueryRow(context.Background(),
		`SELECT EXISTS (SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = $2)`, schema, table).Scan(&ok)
	if err != nil {
		t.Fatal(err)
	}
	return ok
}

func TestConcurrentUpAppliesOnce(t *testing.T) {
	t.Parallel()
	schema := pgtest.EmptySchema(t)
	pool := pgtest.Pool(t)
	all, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	applied := make([][]int, 8)
	errs := make([]error, 8)
	for i := range applied {
		wg.Add(1)
		go func() {
			defer wg.Done()
			applied[i], errs[i] = migrations.Up(context.Background(), pool, schema)
		}()
	}
	wg.Wait()
	total := 0
	for i, err := range errs {
		if err != nil {
			t.Fatalf("Up %d: %v", i, err)
		}
		total += len(applied[i])
	}
	if total != len(all) {
		t.Fatalf("concurrent Up applied %d migrations in all, want %d (each once)", total, len(all))
	}
	for _, table := range []string{"outbox", "outbox_dead", "processed_messages", "relay_shards", "relay_instances"} {
		if !tableExists(t, schema, table) {
			t.Errorf("table %s.%s missing", schema, table)
		}
	}
	again, err := migrations.Up(context.Background(), pool, schema)
	if err != nil || len(again) != 0 {
		t.Fatalf("second Up: applied %v, err %v", again, err)
	}
}

func TestDownOneStepAndList(t *testing.T) {
	t.Parallel()
	schema := pgtest.EmptySchema(t)
	pool := pgtest.Pool(t)
	ctx := context.Background()
	all, _ := migrations.All()
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	status, err := migrations.List(ctx, pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range status {
		if s.AppliedAt == nil {
			t.Errorf("migration %d not applied", s.Version)
		}
	}
	reverted, err := migrations.Down(ctx, pool, schema, 1)
	if err != nil || len(reverted) != 1 || reverted[0] != all[len(all)-1].Version {
		t.Fatalf("Down: reverted %v, err %v", reverted, err)
	}
	if _, err := migrations.Down(ctx, pool, schema, len(all)); err != nil {
		t.Fatal(err)
	}
	if tableExists(t, schema, "outbox") {
		t.Fatal("outbox still exists after reverting everything")
	}
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		t.Fatalf("Up after Down: %v", err)
	}
	if !tableExists(t, schema, "outbox") {
		t.Fatal("outbox missing after Up")
	}
	if _, err := migrations.Down(ctx, pool, schema, 0); err == nil {
		t.Error("Down accepted 0 steps")
	}
}

func TestSchemaNameIsQuotedNotPasted(t *testing.T) {
	t.Parallel()
	schema := pgtest.EmptySchema(t) + `"; DROP TABLE x; --`
	t.Cleanup(func() { pgtest.DropSchema(t, schema) })
	if _, err := migrations.Up(context.Background(), pgtest.Pool(t), schema); err != nil {
		t.Fatal(err)
	}
	if !tableExists(t, schema, "outbox") {
		t.Fatal("outbox not created in the oddly named schema")
	}
}

// Names that would not mean the schema they spell are refused before
// anything runs (Up, Down, List and Check validate as Script does): "$user" in a search_path is the current role's schema
// (the tables went to public while status looked in "$user"), and a line
// break ended the printed script's header comment, so the rest of the name
// ran as SQL.
func TestSchemaNamesThatWouldMeanSomethingElseAreRefused(t *testing.T) {
	t.Parallel()
	// Blanks, or invisible characters (a BOM, a zero-width space: helper
	// 59), around a name templated from the environment make a second
	// schema beside the producers'.
	for _, name := range []string{"$user", "zz_probe\nSELECT 1/0; --", "a\rb", "tab\tname", "del\x7f",
		"onceflow ", " onceflow", "\ufeffonceflow", "onceflow\u200b", "onceflow\u00a0"} {
		if err := migrations.ValidateSchema(name); err == nil {
			t.Errorf("ValidateSchema(%q) accepted it", name)
		}
		if _, err := migrations.Script(name, 0, false); err == nil {
			t.Errorf("Script(%q) printed a script", name)
		}
	}
	for _, name := range []string{"onceflow", "Q\"uo te,Sch", "user", "$usr", "schéma"} {
		if err := migrations.ValidateSchema(name); err != nil {
			t.Errorf("ValidateSchema(%q): %v", name, err)
		}
	}
}
