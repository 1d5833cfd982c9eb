// Package pgtest gives tests a real PostgreSQL: one pool per test binary and
// a freshly migrated schema per test, so tests run in parallel without seeing
// each other's rows.
//
// The database comes from ONCEFLOW_TEST_DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable). When that
// variable is unset, the default is unreachable and a Docker engine is
// healthy, a PostgreSQL container is started with testcontainers-go instead.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
	"github.com/testcontainers/testcontainers-go/wait"

	"github.com/onceflow/onceflow/migrations"
)

// DefaultURL is used when ONCEFLOW_TEST_DATABASE_URL is unset.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

var (
	once    sync.Once
	baseURL string
	pool    *pgxpool.Pool
	initErr error
)

// URL returns the URL of the test database, starting a container if needed.
// It fails the test with a clear message when no database is reachable.
func URL(t testing.TB) string {
	t.Helper()
	setup(t)
	return baseURL
}

// Pool returns the test binary's shared pool.
func Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	setup(t)
	return pool
}

// TracedPool returns a pool of its own whose statements tracer sees,
// closed when the test ends. maxConns 0 keeps pgxpool's default.
func TracedPool(t testing.TB, tracer pgx.QueryTracer, maxConns int32) *pgxpool.Pool {
	t.Helper()
	return PoolWith(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.Tracer = tracer
		if maxConns > 0 {
			cfg.MaxConns = maxConns
		}
	})
}

// PoolWith returns a pool of its own on the test database, its config set
// by configure (session settings, query mode, ...), closed when the test
// ends.
func PoolWith(t testing.TB, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(URL(t))
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	configure(cfg)
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(p.Close)
	return p
}

// Schema creates a fresh schema with every onceflow migration applied, drops
// it when the test ends, and returns its name.
func Schema(t testing.TB) string {
	t.Helper()
	p := Pool(t)
	schema := NewSchemaName()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := migrations.Up(ctx, p, schema); err != nil {
		t.Fatalf("pgtest: migrate schema %s: %v", schema, err)
	}
	t.Cleanup(func() { DropSchema(t, schema) })
	return schema
}

// EmptySchema reserves a schema name that does not exist yet and drops
// whatever a test created under it when the test ends.
func EmptySchema(t testing.TB) string {
	t.Helper()
	Pool(t)
	schema := NewSchemaName()
	t.Cleanup(func() { DropSchema(t, schema) })
	return schema
}

// DropSchema drops a schema and everything in it. Failures are logged only:
// a leftover schema must not fail a test that passed.
func DropSchema(t testing.TB, schema string) {
	if os.Getenv("ONCEFLOW_TEST_KEEP_SCHEMAS") != "" {
		t.Logf("pgtest: keeping schema %s", schema)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		t.Logf("pgtest: drop schema %s: %v", schema, err)
	}
}

// NewSchemaName returns a unique schema name.
func NewSchemaName() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return "oftest_" + hex.EncodeToString(b)
}

// Conn opens a dedicated connection, closed when the test ends.
func Conn(t testing.TB) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, URL(t))
	if err != nil {
		t.Fatalf("pgtest: connect: %v", err)
	}
	t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

func setup(t testing.TB) {
	t.Helper()
	once.Do(func() { baseURL, pool, initErr = connect() })
	if initErr != nil {
		t.Fatalf("pgtest: %v", initErr)
	}
}

func connect() (string, *pgxpool.Pool, error) {
	url, fromEnv := os.LookupEnv("ONCEFLOW_TEST_DATABASE_URL")
	if !fromEnv || url == "" {
		url = DefaultURL
	}
	p, err := open(url)
	if err == nil {
		return url, p, nil
	}
	if !fromEnv && dockerHealthy() {
		containerURL, cerr := startContainer()
		if cerr != nil {
			return "", nil, fmt.Errorf("no database at %s (%v), and starting a PostgreSQL container failed: %v", url, err, cerr)
		}
		p, err = open(containerURL)
		if err == nil {
			return containerURL, p, nil
		}
		url = containerURL
	}
	return "", nil, fmt.Errorf("no PostgreSQL reachable at %s: %v; start one (e.g. `pg_ctlcluster 15 main start`), "+
		"or set ONCEFLOW_TEST_DATABASE_URL to a database the tests may create schemas in", redact(url), err)
}

func open(url string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 32
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := p.Ping(ctx); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

func dockerHealthy() bool {
	provider, err := testcontainers.NewDockerProvider()
	if err != nil {
		return false
	}
	defer provider.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return provider.Health(ctx) == nil
}

// DockerHealthy reports whether a Docker engine answers, for helpers that can
// start containers.
func DockerHealthy() bool { return dockerHealthy() }

func startContainer() (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := tcpostgres.Run(ctx, "postgres:15-alpine",
		tcpostgres.WithDatabase("postgres"),
		tcpostgres.WithUsername("postgres"),
		tcpostgres.WithPassword("postgres"),
		testcontainers.WithWaitStrategy(wait.ForLog("database system is ready to accept connections").WithOccurrence(2)),
	)
	if err != nil {
		return "", err
	}
	return c.ConnectionString(ctx, "sslmode=disable")
}

func redact(url string) string {
	if at := strings.LastIndex(url, "@"); at > 0 {
		if scheme := strings.Index(url, "://"); scheme >= 0 && scheme < at {
			return url[:scheme+3] + "…@" + url[at+1:]
		}
	}
	return url
}
