package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/onceflow/onceflow/relay"
)

func runDead(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	sub, rest, err := subcommand(args, "list", "replay")
	if err == flag.ErrHelp {
		fmt.Fprintln(stderr, "Usage: onceflow dead list|replay [flags]; see 'onceflow dead list --help'")
		return err
	}
	if err != nil {
		return err
	}
	var c common
	summary := "List events Kafka refused for good, oldest first."
	if sub == "replay" {
		summary = "Move dead events back into the outbox (keeping their event id) for the relay to publish again."
	}
	fs := newFlagSet("dead "+sub, summary, stderr)
	c.register(fs, false)
	limit := fs.Int("limit", 100, "with list: how many to show")
	ids := fs.String("ids", "", "with replay: comma-separated outbox_dead ids")
	all := fs.Bool("all", false, "with replay: replay every dead event")
	if err := c.parse(fs, rest, false); err != nil {
		return err
	}
	var idList []int64
	if sub == "replay" {
		switch {
		case *all && *ids != "":
			return fmt.Errorf("%w: give --ids or --all, not both", errUsage)
		case !*all && *ids == "":
			return fmt.Errorf("%w: replay needs --ids or --all", errUsage)
		}
		for _, s := range strings.Split(*ids, ",") {
			if s = strings.TrimSpace(s); s == "" {
				continue
			}
			id, err := strconv.ParseInt(s, 10, 64)
			if err != nil {
				return fmt.Errorf("%w: --ids: %q is not a number", errUsage, s)
			}
			idList = append(idList, id)
		}
	}
	pool, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if sub == "list" {
		dead, err := relay.ListDead(ctx, pool, c.schema, *limit)
		if err != nil {
			return err
		}
		if len(dead) == 0 {
			fmt.Fprintln(stdout, "no dead events")
		}
		for _, d := range dead {
			fmt.Fprintf(stdout, "%d  event %s  topic %s  key %q  %d bytes  attempts %d  dead %s\n    error: %s\n",
				d.ID, d.EventID, d.Topic, d.Key, len(d.Value), d.Attempts, d.DeadAt.Format("2006-01-02 15:04:05Z07:00"), d.Error)
		}
		return nil
	}
	n, err := relay.ReplayDead(ctx, pool, c.schema, idList)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "replayed %d dead events into the outbox\n", n)
	return nil
}
