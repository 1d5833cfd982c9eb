package relay_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// relayRole returns a pool of a role with the grants README's "Roles and
// privileges" gives the relay on schema, but for skip (one of relayGrants).
func relayRole(t *testing.T, schema, skip string) *pgxpool.Pool {
	t.Helper()
	var seq string
	if err := pgtest.Pool(t).QueryRow(context.Background(), `SELECT pg_get_serial_sequence($1, 'id')`, pgx.Identifier{schema, "outbox"}.Sanitize()).Scan(&seq); err != nil {
		t.Fatal(err)
	}
	var grants []string
	for _, g := range relayGrants {
		if g != skip {
			grants = append(grants, strings.ReplaceAll(g, "{seq}", seq))
		}
	}
	if skip != "" && len(grants) == len(relayGrants) {
		t.Fatalf("no grant %q", skip)
	}
	return pgtest.RolePool(t, schema, grants...)
}

// relayGrants are the relay's privileges as README's "Roles and
// privileges" lists them.
var relayGrants = []string{
	`GRANT USAGE ON SCHEMA {s} TO {role}`,
	`GRANT SELECT ON {s}.schema_migrations TO {role}`,
	`GRANT SELECT, UPDATE ON {s}.outbox TO {role}`,
	`GRANT DELETE ON {s}.outbox TO {role}`,
	`GRANT SELECT, INSERT ON {s}.outbox_dead TO {role}`,
	`GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.relay_instances TO {role}`,
	`GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.relay_rounds TO {role}`,
	`GRANT SELECT, UPDATE ON {s}.relay_shards TO {role}`,
	`GRANT SELECT ON SEQUENCE {seq} TO {role}`,
}

// A relay whose role lacks a privilege it needs stops with an error saying
// so, at start or when it first meets the refusal, instead of retrying
// what a grant alone mends (helper 76): without UPDATE on relay_instances
// it retried its first lease round for ever, owning no shard while
// /readyz said ready; without DELETE on the outbox it published the same
// 5 events 235 times in 10 s; without SELECT on the outbox's sequence its
// probe failed silently and it fell back to polling, ten times slower.
// With every grant the README lists, it drains the outbox.
func TestARelayWithoutAPrivilegeItNeedsStopsAndSaysSo(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, skip string
	}{
		{"every grant", ""},
		{"no UPDATE on relay_instances", `GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.relay_instances TO {role}`},
		{"no DELETE on the outbox", `GRANT DELETE ON {s}.outbox TO {role}`},
		{"no SELECT on the sequence", `GRANT SELECT ON SEQUENCE {seq} TO {role}`},
		{"no SELECT on schema_migrations", `GRANT SELECT ON {s}.schema_migrations TO {role}`},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			pool := relayRole(t, b.schema, c.skip)
			topic := b.kafka.Topic(t, 2)
			var msgs []outbox.Message
			for i := range 5 {
				msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint("k", i)), Value: []byte("v")})
			}
			b.write(t, msgs...)
			r, err := relay.New(pool, b.publisher(t), &relay.Config{Schema: b.schema, PollInterval: 50 * time.Millisecond, LeaseDuration: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- r.Run(ctx) }()
			if c.skip == "" {
				waitFor(t, "the relay to drain the outbox", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
				cancel()
				if err := <-done; err != nil {
					t.Fatalf("Run: %v", err)
				}
				return
			}
			select {
			case err := <-done:
				if !errors.Is(err, relay.ErrInsufficientPrivilege) || !strings.Contains(err.Error(), "permission denied") {
					t.Fatalf("Run returned %v, want an error wrapping ErrInsufficientPrivilege and the database's refusal", err)
				}
			case <-time.After(20 * time.Second):
				t.Fatal("the relay still runs 20 s after its role was refused: it retries what only a grant mends")
			}
		})
	}
}

// Row-level security on the outbox that applies to the relay's role (a
// policy letting the writer insert) hid every row from the relay without
// an error: it published nothing, its backlog read 0 and no alert fired
// (helper 76). The relay refuses to start, naming the table; as a role
// row-level security does not bind (the tests' superuser, or the table's
// owner), it runs.
func TestARelayRefusesRowLevelSecurityThatHidesTheOutbox(t *testing.T) {
	t.Parallel()
	b := setup(t)
	outboxTable := pgx.Identifier{b.schema, "outbox"}.Sanitize()
	for _, q := range []string{
		`ALTER TABLE ` + outboxTable + ` ENABLE ROW LEVEL SECURITY`,
		`CREATE POLICY writers_insert ON ` + outboxTable + ` FOR INSERT WITH CHECK (true)`,
	} {
		if _, err := b.pool.Exec(context.Background(), q); err != nil {
			t.Fatal(err)
		}
	}
	pool := relayRole(t, b.schema, "")
	r, err := relay.New(pool, b.publisher(t), &relay.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := r.Run(ctx); !errors.Is(err, relay.ErrInsufficientPrivilege) || ctx.Err() != nil || !strings.Contains(err.Error(), "row-level security applies to this relay's role on "+b.schema+".outbox,") {
		t.Fatalf("Run returned %v (context: %v), want a refusal naming the outbox's row-level security", err, ctx.Err())
	}
	b.write(t, outbox.Message{Topic: b.kafka.Topic(t, 1), Key: []byte("k"), Value: []byte("v")})
	_, stop := b.startRelay(t, relay.Config{})
	defer stop()
	waitFor(t, "the relay to drain the outbox", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
}

// Row-level security on a table the relay does not use (the middleware's
// idempotency_keys, per tenant) is no reason to refuse: the first check
// looked at every table of the schema (helper 77).
func TestRowLevelSecurityOnAnotherServicesTableIsNotTheRelays(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if _, err := b.pool.Exec(context.Background(), `ALTER TABLE `+pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize()+` ENABLE ROW LEVEL SECURITY`); err != nil {
		t.Fatal(err)
	}
	b.write(t, outbox.Message{Topic: b.kafka.Topic(t, 1), Key: []byte("k"), Value: []byte("v")})
	_, stop := b.startRelayOn(t, relayRole(t, b.schema, ""), relay.Config{})
	defer stop()
	waitFor(t, "the relay to drain the outbox", 30*time.Second, func() bool { return b.count(t, "outbox") == 0 })
}

// A relay whose role may not write back rows of relay_shards deleted by
// hand (the README's grants leave INSERT out) says so once, not on every
// lease tick: three relays logged 724 warnings in 50 s (helper 77).
func TestARefusedWriteBackOfShardRowsIsLoggedOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if _, err := b.pool.Exec(context.Background(), `DELETE FROM `+pgx.Identifier{b.schema, "relay_shards"}.Sanitize()+` WHERE shard = 7`); err != nil {
		t.Fatal(err)
	}
	logger, logs := newLogger(slog.LevelInfo)
	_, stop := b.startRelayOn(t, relayRole(t, b.schema, ""), relay.Config{Logger: logger, LeaseDuration: 300 * time.Millisecond})
	time.Sleep(3 * time.Second) // about 30 lease ticks
	stop()
	if n := len(logs.lines(`writing them back failed`)); n != 1 {
		t.Fatalf("%d warnings of the refused write-back over 3 s, want one:\n%s", n, logs.String())
	}
}

// Row-level security switched on while a relay runs hid every event from
// it, as at start, but the check ran only at start: the relay idled with a
// backlog it could not see (its backlog gauge, read by the same role, said
// 0), until someone noticed the consumers had gone quiet. It is checked on
// every lease tick now: the relay stops, naming the table, and the events
// it could not see stay in the outbox for a relay that can.
func TestARelayStopsWhenRowLevelSecurityIsSwitchedOnUnderIt(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic := b.kafka.Topic(t, 1)
	pool := relayRole(t, b.schema, "")
	r, err := relay.New(pool, b.publisher(t), &relay.Config{Schema: b.schema, PollInterval: 50 * time.Millisecond, LeaseDuration: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	b.write(t, outbox.Message{Topic: topic, Key: []byte("k"), Value: []byte("before")})
	waitFor(t, "the relay to publish the first event", 20*time.Second, func() bool { return b.count(t, "outbox") == 0 })
	if _, err := b.pool.Exec(context.Background(), `ALTER TABLE `+pgx.Identifier{b.schema, "outbox"}.Sanitize()+` ENABLE ROW LEVEL SECURITY`); err != nil {
		t.Fatal(err)
	}
	b.write(t, outbox.Message{Topic: topic, Key: []byte("k"), Value: []byte("after")})
	select {
	case err := <-done:
		if !errors.Is(err, relay.ErrInsufficientPrivilege) || !strings.Contains(err.Error(), b.schema+".outbox") {
			t.Fatalf("Run returned %v, want a refusal naming the outbox's row-level security", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the relay ran on for 10 s with row-level security hiding the outbox from its role")
	}
	if n := b.count(t, "outbox"); n != 1 {
		t.Fatalf("outbox holds %d events, want the one written after row-level security was switched on", n)
	}
}
