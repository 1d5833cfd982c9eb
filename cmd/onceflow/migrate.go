package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/onceflow/onceflow/migrations"
)

func runMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	sub, rest, err := subcommand(args, "up", "down", "status")
	if err == flag.ErrHelp {
		fmt.Fprintln(stderr, "Usage: onceflow migrate up|down|status [flags]; see 'onceflow migrate up --help'")
		return err
	}
	if err != nil {
		return err
	}
	var c common
	fs := newFlagSet("migrate "+sub, map[string]string{
		"up":     "Apply every pending migration (idempotent; safe when several processes run it at once).",
		"down":   "Revert the newest applied migration(s).",
		"status": "List migrations and when each was applied.",
	}[sub], stderr)
	c.register(fs, false)
	steps := fs.Int("steps", 1, "with down: how many migrations to revert")
	if err := c.parse(fs, rest, false); err != nil {
		return err
	}
	pool, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	switch sub {
	case "up":
		applied, err := migrations.Up(ctx, pool, c.schema)
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
		if *steps < 1 {
			return fmt.Errorf("%w: --steps must be at least 1", errUsage)
		}
		reverted, err := migrations.Down(ctx, pool, c.schema, *steps)
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
		list, err := migrations.List(ctx, pool, c.schema)
		if err != nil {
			return err
		}
		for _, s := range list {
			state := "pending"
			if s.AppliedAt != nil {
				state = "applied " + s.AppliedAt.Format("2006-01-02 15:04:05Z07:00")
			}
			fmt.Fprintf(stdout, "%04d %-20s %s\n", s.Version, s.Name, state)
		}
	}
	return nil
}
