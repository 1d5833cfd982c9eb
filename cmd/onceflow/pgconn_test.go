package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgbouncertest"
	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/internal/tlstest"
)

// TestDatabasePasswordSources: behind a PgBouncer that requires a SCRAM
// password, the password is taken from the URL, PGPASSWORD, a .pgpass file
// (PGPASSFILE) or --database-password-file; without one, `status` fails
// and the relay exits at once (waiting cannot fix a password).
func TestDatabasePasswordSources(t *testing.T) {
	pgb := pgbouncertest.Start(t)
	schema := pgtest.Schema(t)
	bare := fmt.Sprintf("postgres://postgres@%s/session?sslmode=disable", pgb.Addr)
	t.Setenv("PGPASSWORD", "")
	os.Unsetenv("PGPASSWORD")
	t.Setenv("PGPASSFILE", filepath.Join(t.TempDir(), "none"))
	status := func(args ...string) error {
		_, err := runCLI(t, append([]string{"status", "--schema", schema}, args...)...)
		return err
	}
	if err := status("--database-url", bare); err == nil || !strings.Contains(err.Error(), "authentication") {
		t.Fatalf("no password: %v, want an authentication error", err)
	}
	if err := status("--database-url", pgb.SessionURL); err != nil {
		t.Fatalf("password in the URL: %v", err)
	}
	file := filepath.Join(t.TempDir(), "pw")
	if err := os.WriteFile(file, []byte(pgb.Password+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	wrong := fmt.Sprintf("postgres://postgres:wrong@%s/session?sslmode=disable", pgb.Addr)
	if err := status("--database-url", wrong, "--database-password-file", file); err != nil {
		t.Fatalf("--database-password-file over a wrong URL password: %v", err)
	}
	t.Setenv("ONCEFLOW_DATABASE_PASSWORD_FILE", file)
	if err := status("--database-url", bare); err != nil {
		t.Fatalf("ONCEFLOW_DATABASE_PASSWORD_FILE: %v", err)
	}
	os.Unsetenv("ONCEFLOW_DATABASE_PASSWORD_FILE")
	pass := filepath.Join(t.TempDir(), "pgpass")
	host, port, _ := strings.Cut(pgb.Addr, ":")
	if err := os.WriteFile(pass, []byte(fmt.Sprintf("%s:%s:session:postgres:%s\n", host, port, pgb.Password)), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PGPASSFILE", pass)
	if err := status("--database-url", bare); err != nil {
		t.Fatalf(".pgpass: %v", err)
	}
	t.Setenv("PGPASSFILE", filepath.Join(t.TempDir(), "none"))
	t.Setenv("PGPASSWORD", pgb.Password)
	if err := status("--database-url", bare); err != nil {
		t.Fatalf("PGPASSWORD: %v", err)
	}
	os.Unsetenv("PGPASSWORD")

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out strings.Builder
	err := run(ctx, []string{"relay", "--database-url", bare, "--schema", schema, "--brokers", "127.0.0.1:1"}, &out, &out)
	if err == nil || ctx.Err() != nil || !strings.Contains(err.Error(), "authentication") {
		t.Fatalf("relay without a password: %v (ctx %v), want an immediate authentication error", err, ctx.Err())
	}
}

// TestDatabaseSSLModeIsHonoured: sslmode and sslrootcert in the URL are
// applied (pgx reads them): verify-full with PgBouncer's certificate
// connects over TLS; with another CA's it fails on the certificate, and the
// relay exits at once instead of waiting.
func TestDatabaseSSLModeIsHonoured(t *testing.T) {
	pgb := pgbouncertest.Start(t)
	schema := pgtest.Schema(t)
	base := fmt.Sprintf("postgres://postgres:%s@%s/session", pgb.Password, pgb.Addr)
	if _, err := runCLI(t, "status", "--schema", schema, "--database-url", base+"?sslmode=verify-full&sslrootcert="+pgb.CAFile); err != nil {
		t.Fatalf("verify-full with the right CA: %v", err)
	}
	other := tlstest.New(t)
	wrong := base + "?sslmode=verify-full&sslrootcert=" + other.CAFile
	if _, err := runCLI(t, "status", "--schema", schema, "--database-url", wrong); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("verify-full with another CA: %v, want a certificate error", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out strings.Builder
	err := run(ctx, []string{"relay", "--database-url", wrong, "--schema", schema, "--brokers", "127.0.0.1:1"}, &out, &out)
	if err == nil || ctx.Err() != nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("relay with a certificate that does not verify: %v (ctx %v), want an immediate error", err, ctx.Err())
	}
}

func TestDatabasePoolSize(t *testing.T) {
	c := common{databaseURL: "postgres://u@h/d?pool_max_conns=7"}
	cfg, err := c.poolConfig()
	if err != nil || cfg.MaxConns != 7 {
		t.Fatalf("pool_max_conns in the URL: %v, %v", cfg.MaxConns, err)
	}
	c.poolSize = 3
	if cfg, err = c.poolConfig(); err != nil || cfg.MaxConns != 3 {
		t.Fatalf("--database-pool-size 3: %v, %v", cfg.MaxConns, err)
	}
	c.poolSize = -1
	if _, err = c.poolConfig(); err == nil || !strings.Contains(err.Error(), "--database-pool-size") {
		t.Fatalf("--database-pool-size -1: %v", err)
	}
}

// TestAdminCommandsWorkBehindATransactionPooler: status, dead and migrate
// run a few statements and exit, so they gain nothing from pgx's cached
// prepared statements; behind PgBouncer in transaction mode those failed
// ("prepared statement … already exists (SQLSTATE 42P05)" from the second
// run on, the server connection keeping the first run's statements). They
// now use the exec mode unless the URL names a mode.
func TestAdminCommandsWorkBehindATransactionPooler(t *testing.T) {
	pgb := pgbouncertest.Start(t)
	schema := pgtest.Schema(t)
	ctx := context.Background()
	if _, err := pgtest.Pool(t).Exec(ctx, `INSERT INTO `+schema+`.outbox_dead (outbox_id, event_id, topic, key, value, created_at, error, attempts)
SELECT g, gen_random_uuid(), 'gone', 'k', 'v', now(), 'unknown topic', 3 FROM generate_series(1, 3) g`); err != nil {
		t.Fatal(err)
	}
	through := []string{"--database-url", pgb.TransactionURL, "--schema", schema}
	for run := 1; run <= 3; run++ {
		steps := []struct {
			args []string
			want string
		}{
			{[]string{"migrate", "status"}, "0010 janitor_windows"},
			{[]string{"migrate", "up"}, "is up to date"},
			{[]string{"status"}, "dead letters:    " + fmt.Sprint(4-run)},
			{[]string{"dead", "list"}, "unknown topic"},
			{[]string{"dead", "replay", "--ids", fmt.Sprint(run)}, "replayed 1"},
		}
		for _, s := range steps {
			out, err := runCLI(t, append(s.args, through...)...)
			if err != nil || !strings.Contains(out, s.want) {
				t.Fatalf("run %d, %s through the transaction pooler: %v\n%s", run, strings.Join(s.args, " "), err, out)
			}
		}
	}
	var backlog int
	if err := pgtest.Pool(t).QueryRow(ctx, `SELECT count(*) FROM `+schema+`.outbox`).Scan(&backlog); err != nil || backlog != 3 {
		t.Fatalf("outbox after three replays: %d rows (%v), want 3", backlog, err)
	}
}

// helper 118: --database-password-file was read once, at start. A password
// rotated in place (a Vault or RDS credential written to a mounted file,
// the old one revoked) wedged every relay once its pool opened new
// connections: each login used the old password, and /livez stayed 200 (the
// loop kept beating, its rounds failing). The file is read for every new
// connection. Here the file turns wrong and right again under one pool.
func TestDatabasePasswordFileIsReadForEveryConnection(t *testing.T) {
	pgb := pgbouncertest.Start(t)
	file := filepath.Join(t.TempDir(), "pw")
	write := func(pw string) {
		if err := os.WriteFile(file+".new", []byte(pw+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(file+".new", file); err != nil {
			t.Fatal(err)
		}
	}
	write(pgb.Password)
	c := &common{databaseURL: fmt.Sprintf("postgres://postgres@%s/session?sslmode=disable", pgb.Addr), passwordFile: file}
	cfg, err := c.poolConfig()
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ping := func() error {
		pool.Reset() // the next statement opens a new connection
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return pool.Ping(ctx)
	}
	if err := ping(); err != nil {
		t.Fatalf("with the file's password: %v", err)
	}
	write("revoked-password")
	if err := ping(); err == nil || !strings.Contains(err.Error(), "authentication") {
		t.Fatalf("a new connection after the file changed to a wrong password: %v, want an authentication error (the file read again)", err)
	}
	write(pgb.Password)
	if err := ping(); err != nil {
		t.Fatalf("a new connection after the file changed back: %v", err)
	}
}
