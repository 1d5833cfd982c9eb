package relay_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// textResultSettings are settings that change how PostgreSQL writes results
// as text, in the form pgx cannot read: bytea not in hex, dates not in ISO.
// A database or role may carry them for a legacy application. The last is
// one pgx reads.
var textResultSettings = []struct{ name, set string }{
	{"bytea_output", `SET bytea_output = 'escape'`},
	{"DateStyle", `SET DateStyle = 'SQL, DMY'`},
	{"DateStyle", `SET DateStyle = 'German'`},
	{"DateStyle", `SET DateStyle = 'Postgres, MDY'`},
	// Readable: no refusal (name "").
	{"", `SET DateStyle = 'ISO, DMY'`},
}

// settingPool is a pool sending statements in mode whose connections run
// set when they connect.
func settingPool(t *testing.T, mode pgx.QueryExecMode, set string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.DefaultQueryExecMode = mode
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, set)
		return err
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// In exec and simple_protocol mode (PgBouncer in transaction mode) results
// come as text. Under a bytea_output or DateStyle pgx cannot read, a relay
// used to retry forever with a scan error ("invalid hex format", "invalid
// PostgreSQL date/time value"), publishing nothing. It must publish, or
// refuse at start with an error naming the setting and the remedy; in the
// binary-result modes it publishes.
func TestRelayUnderTextResultSettings(t *testing.T) {
	t.Parallel()
	for _, s := range textResultSettings {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
			t.Run(s.set+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				b := setup(t)
				topic := b.kafka.Topic(t, 1)
				b.write(t, outbox.Message{Topic: topic, Key: []byte{0, 'k', 0xff, '\\'}, Value: []byte("v\\x")})
				pool := settingPool(t, mode, s.set)
				r, err := relay.New(pool, b.publisher(t), &relay.Config{Schema: b.schema, PollInterval: 50 * time.Millisecond, LeaseDuration: time.Second})
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				done := make(chan error, 1)
				go func() { done <- r.Run(ctx) }()
				deadline := time.After(8 * time.Second)
				for b.count(t, "outbox") != 0 {
					select {
					case err := <-done:
						if mode == pgx.QueryExecModeCacheStatement || s.name == "" {
							t.Fatalf("Run in %s: %v", mode, err)
						}
						checkTextResultRefusal(t, err, s.name)
						return
					case <-deadline:
						cancel()
						<-done
						t.Fatalf("nothing published in 8 s, and Run did not refuse (it retries a scan error)")
					case <-time.After(50 * time.Millisecond):
					}
				}
				cancel()
				if err := <-done; err != nil {
					t.Fatalf("Run: %v", err)
				}
				recs := b.kafka.ReadAll(t, topic, 1, 5*time.Second)
				if string(recs[0].Key) != "\x00k\xff\\" || string(recs[0].Value) != "v\\x" {
					t.Fatalf("published key %q value %q", recs[0].Key, recs[0].Value)
				}
			})
		}
	}
}

// checkTextResultRefusal fails t unless err is ErrTextResultSettings
// naming setting, its value and the remedy.
func checkTextResultRefusal(t *testing.T, err error, setting string) {
	t.Helper()
	if err == nil {
		t.Fatal("Run returned nil before publishing")
	}
	msg := err.Error()
	if !errors.Is(err, relay.ErrTextResultSettings) || !strings.Contains(msg, setting+" is ") || !strings.Contains(msg, "ALTER ROLE") {
		t.Fatalf("Run refused with %q, want the setting %s and the remedy (ALTER ROLE ... SET) named", msg, setting)
	}
}
