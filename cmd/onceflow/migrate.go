package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/migrations"
)

const migrateUsage = `Usage: onceflow migrate up|down|status|print [flags]

  up       apply every pending migration
  down     revert the newest applied migration(s)
  status   list migrations and when each was applied
  print    print the migrations as SQL for your own migration tool

Run 'onceflow migrate up --help' (or down, status, print) for a subcommand's flags.
`

func runMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	sub, rest, err := subcommand(args, "up", "down", "status", "print")
	if err == flag.ErrHelp {
		fmt.Fprint(stderr, migrateUsage)
		return err
	}
	if err != nil {
		return err
	}
	if sub == "print" {
		return runMigratePrint(rest, stdout, stderr)
	}
	var c common
	var steps *int
	var force *bool
	var lockTimeout *time.Duration
	switch sub {
	case "up":
		fs := newFlagSet("migrate up", "Apply every pending migration (idempotent; safe when several processes run it at once), all in one\n"+
			"transaction. A step that waits for a table's lock (behind an open transaction that read the outbox, say)\n"+
			"holds off every producer meanwhile, so the wait is bounded: past --lock-timeout, apply nothing and name\n"+
			"the sessions holding the tables; run it again when they are gone.", stderr)
		c.register(fs, false)
		lockTimeout = lockTimeoutFlag(fs, "apply nothing")
		if err := c.parseAdmin(ctx, fs, rest, stderr); err != nil {
			return err
		}
		if err := checkLockTimeout(*lockTimeout); err != nil {
			return err
		}
	case "down":
		fs := newFlagSet("migrate down", "Revert the newest applied migration(s). Refuses, reverting nothing, when a table it\n"+
			"would drop holds rows (outbox, outbox_dead, processed_messages, idempotency_keys; dead_replays\nfor events still pending or dead; janitor_windows swept lately) unless --force. A schema that was never migrated is left alone.", stderr)
		c.register(fs, false)
		steps = fs.Int("steps", 1, "how many migrations to revert")
		force = fs.Bool("force", false, "drop tables even when they hold pending events, dead letters, dedup records, idempotency keys, dead events' write order or live janitor windows")
		lockTimeout = lockTimeoutFlag(fs, "revert nothing")
		if err := c.parseAdmin(ctx, fs, rest, stderr); err != nil {
			return err
		}
		if *steps < 1 {
			return fmt.Errorf("%w: --steps must be at least 1", errUsage)
		}
		if err := checkLockTimeout(*lockTimeout); err != nil {
			return err
		}
	case "status":
		fs := newFlagSet("migrate status", "List migrations and when each was applied.", stderr)
		c.register(fs, false)
		if err := c.parseAdmin(ctx, fs, rest, stderr); err != nil {
			return err
		}
	}
	pool, err := c.connectAdmin(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	switch sub {
	case "up":
		applied, err := migrations.UpWith(ctx, pool, c.schema, &migrations.UpConfig{LockTimeout: *lockTimeout})
		if err != nil {
			return err
		}
		if len(applied) == 0 {
			fmt.Fprintf(stdout, "schema %s is up to date\n", c.schema)
		}
		for _, v := range applied {
			fmt.Fprintf(stdout, "applied %04d to schema %s\n", v, c.schema)
		}
	case "down":
		reverted, err := migrations.DownWith(ctx, pool, c.schema, *steps, &migrations.DownConfig{Force: *force, LockTimeout: *lockTimeout})
		if err != nil {
			return err
		}
		if len(reverted) == 0 {
			fmt.Fprintf(stdout, "nothing to revert in schema %s\n", c.schema)
		}
		for _, v := range reverted {
			fmt.Fprintf(stdout, "reverted %04d in schema %s\n", v, c.schema)
		}
	case "status":
		var list []migrations.Status
		err := readTx(ctx, pool, "", func(tx pgx.Tx) error {
			var err error
			list, err = migrations.List(ctx, tx, c.schema) // a savepoint in tx
			return err
		})
		if err != nil {
			return err
		}
		for _, s := range list {
			state := "pending"
			if s.AppliedAt != nil {
				state = "applied " + s.AppliedAt.Format("2006-01-02 15:04:05Z07:00")
			}
			if s.Version > migrations.Latest() {
				state += " (unknown to this onceflow: a newer one applied it)"
			}
			fmt.Fprintf(stdout, "%04d %-20s %s\n", s.Version, s.Name, state)
		}
	}
	return nil
}

// lockTimeoutFlag registers migrate up's and down's --lock-timeout; past
// it they do what past says.
func lockTimeoutFlag(fs *flag.FlagSet, past string) *time.Duration {
	return fs.Duration("lock-timeout", envDuration("ONCEFLOW_MIGRATE_LOCK_TIMEOUT", migrations.DefaultLockTimeout),
		"longest wait for each table lock (producers queue behind the wait; it replaces a lock_timeout the URL sets); past it, "+
			past+" and name the sessions holding the tables (env ONCEFLOW_MIGRATE_LOCK_TIMEOUT)")
}

func checkLockTimeout(d time.Duration) error {
	if d < time.Millisecond || d > migrations.MaxLockTimeout {
		return fmt.Errorf("%w: --lock-timeout must be from 1ms to %s (PostgreSQL's limit)", errUsage, migrations.MaxLockTimeout)
	}
	return nil
}

const migratePrintSummary = `Print onceflow's migrations as SQL for teams that run their own migration tool
(goose, Flyway, Atlas, psql …). Each step creates what it needs in the schema
and records its version in <schema>.schema_migrations, so 'onceflow migrate up'
later finds nothing to do and the relay's schema check passes. Apply an up script
in one transaction, as 'onceflow migrate up' does: tools that run each file in a
transaction do; with psql, psql -1 -v ON_ERROR_STOP=1 -f FILE. Up scripts carry
goose's annotations (comments to psql and Flyway) and no Down part: revert with
'onceflow migrate down', then 'goose down' only forgets the version. Needs no database.

  onceflow migrate print > onceflow.sql                  every migration, one script
  onceflow migrate print --version 2 > 0002.up.sql       one step, for one file per version
  onceflow migrate print --version 2 --down              that step's revert (refusing to drop
                                                         tables that hold rows, unless --force)`

func runMigratePrint(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("migrate print", migratePrintSummary, stderr)
	schema := fs.String("schema", env("ONCEFLOW_SCHEMA", migrations.DefaultSchema), "schema the SQL targets (env ONCEFLOW_SCHEMA)")
	version := fs.Int("version", 0, fmt.Sprintf("print only this migration (1 to %d); default all", migrations.Latest()))
	down := fs.Bool("down", false, "print the revert of --version instead; it refuses, dropping nothing, when a table it drops holds rows, as migrate down does")
	force := fs.Bool("force", false, "with --down: drop tables even when they hold pending events, dead letters, dedup records, idempotency keys, dead events' write order or live janitor windows")
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return err
		}
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	// No logging flags here (print needs no database): the environment's.
	warnUnknownEnv(stderr, env("ONCEFLOW_LOG_FORMAT", "text"), env("ONCEFLOW_LOG_LEVEL", "info"))
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected argument %q", errUsage, fs.Arg(0))
	}
	if *version < 0 || *version > migrations.Latest() {
		return fmt.Errorf("%w: --version: no migration %d (1 to %d)", errUsage, *version, migrations.Latest())
	}
	if *down && *version == 0 {
		return fmt.Errorf("%w: --down needs --version", errUsage)
	}
	if *force && !*down {
		return fmt.Errorf("%w: --force needs --down", errUsage)
	}
	if err := migrations.ValidateSchema(*schema); err != nil {
		return fmt.Errorf("%w: --schema: %v", errUsage, err)
	}
	sql, err := migrations.Script(*schema, *version, *down)
	if *force {
		sql, err = migrations.ScriptForce(*schema, *version)
	}
	if err != nil {
		return err
	}
	_, err = io.WriteString(stdout, sql)
	return err
}
