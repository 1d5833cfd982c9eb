package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/relay"
)

const deadUsage = `Usage: onceflow dead list|replay|discard [flags]

  list      show events Kafka refused for good, oldest first
  replay    move dead events back into the outbox (keeping their event id)
  discard   delete dead events for good, printing each one

Run 'onceflow dead list --help' (or replay, discard) for a subcommand's flags.
`

func runDead(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	sub, rest, err := subcommand(args, "list", "replay", "discard")
	if err == flag.ErrHelp {
		fmt.Fprint(stderr, deadUsage)
		return err
	}
	if err != nil {
		return err
	}
	var c common
	switch sub {
	case "list":
		fs := newFlagSet("dead list", "List events Kafka refused for good, oldest first.", stderr)
		c.register(fs, false)
		limit := fs.Int("limit", 100, "how many to show; a list cut short says how many there are")
		asJSON := fs.Bool("json", false, "print a JSON array (key and value base64-encoded)")
		if err := c.parseAdmin(ctx, fs, rest, stderr); err != nil {
			return err
		}
		if *limit < 1 {
			return fmt.Errorf("%w: --limit must be at least 1", errUsage)
		}
		pool, err := c.connectMigrated(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		// One snapshot for the events and their count, so that the count
		// says how many there were of the ones shown.
		var dead []relay.DeadEvent
		total := -1
		err = readTx(ctx, pool, pgx.RepeatableRead, func(tx pgx.Tx) error {
			var err error
			if dead, err = relay.ListDead(ctx, tx, c.schema, *limit); err != nil || len(dead) < *limit {
				return err
			}
			// Maybe cut: count them all (a scan, as onceflow status does).
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{c.schema, "outbox_dead"}.Sanitize()).Scan(&total); err != nil {
				return fmt.Errorf("count dead events: %w", err)
			}
			return nil
		})
		if err != nil {
			return err
		}
		// Said on stderr with --json, which keeps stdout one JSON array.
		note := stdout
		if *asJSON {
			if err := printDeadJSON(stdout, dead); err != nil {
				return err
			}
			note = stderr
		} else {
			if len(dead) == 0 {
				fmt.Fprintln(stdout, "no dead events")
			}
			for _, d := range dead {
				printDead(stdout, d, false)
			}
		}
		if total > len(dead) {
			fmt.Fprintf(note, "showing %d of %d dead events (oldest first; raise --limit for more)\n", len(dead), total)
		}
		return nil
	case "replay":
		fs := newFlagSet("dead replay", "Move dead events back into the outbox (keeping their event id) for the relay to publish again,\n"+
			"in their keys' write order. If an id is not a dead event, nothing is replayed and the command fails\n"+
			"naming it. If a replayed event's key has an earlier dead event not among the ids, nothing is\n"+
			"replayed and the command fails naming it (the key's events would be published out of order),\n"+
			"unless --out-of-order.", stderr)
		c.register(fs, false)
		ids := idsFlag(fs, "comma-separated outbox_dead ids (see 'onceflow dead list'; may be given more than once)")
		all := fs.Bool("all", false, "replay every dead event")
		outOfOrder := fs.Bool("out-of-order", false, "replay the ids even if earlier dead events of their keys stay dead (published after them, if ever)")
		if err := c.parseAdmin(ctx, fs, rest, stderr); err != nil {
			return err
		}
		idList, err := parseIDs(fs, *ids, *all)
		if err != nil {
			return err
		}
		var opts []relay.ReplayOption
		if *outOfOrder {
			opts = append(opts, relay.ReplayOutOfOrder())
		}
		pool, err := c.connectMigrated(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		// In a transaction of its own: an id another terminal's replay or
		// discard took while this one waited for its row fails the command,
		// and the ids it did move must not stay moved ("nothing is
		// replayed", as its help says).
		var n int
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if err := readableText(ctx, tx); err != nil {
				return err
			}
			n, err = relay.ReplayDead(ctx, tx, c.schema, idList, opts...)
			return err
		})
		var order *relay.DeadOutOfOrderError
		var unfit *relay.DeadUnreplayableError
		var nf *relay.DeadNotFoundError
		switch {
		case errors.As(err, &order):
			return fmt.Errorf("%w (add them to --ids, or pass --out-of-order)", err)
		case errors.As(err, &unfit):
			return fmt.Errorf("%w (onceflow dead discard --ids %s)", err, joinIDs(unfit.IDs))
		case errors.As(err, &nf):
			nf.Done = 0 // rolled back
			return fmt.Errorf("replay dead events (nothing was replayed): %w", err)
		case err != nil:
			return err
		}
		fmt.Fprintf(stdout, "replayed %d dead events into the outbox\n", n)
		return nil
	default: // discard
		fs := newFlagSet("dead discard", "Delete dead events for good: events that must never be sent. Each discarded\n"+
			"event is printed in full (use --json to keep a copy). If an id is not a dead\nevent, nothing is discarded and the command fails naming it.", stderr)
		c.register(fs, false)
		ids := idsFlag(fs, "comma-separated outbox_dead ids (required; see 'onceflow dead list'; may be given more than once)")
		asJSON := fs.Bool("json", false, "print the discarded events as a JSON array (key and value base64-encoded)")
		if err := c.parseAdmin(ctx, fs, rest, stderr); err != nil {
			return err
		}
		idList, err := parseIDs(fs, *ids, false)
		if err != nil {
			return err
		}
		pool, err := c.connectMigrated(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		return discard(ctx, pool, c.schema, idList, *asJSON, stdout, stderr)
	}
}

// discard deletes the dead events ids in one transaction that commits only
// once their copy is written to stdout: the printed events are the only
// copy left, and a failed write rolls the delete back. The copy is written
// before the commit, so it says so; "discarded N dead events" follows only
// once the commit has succeeded (on stderr with asJSON, which keeps stdout
// one JSON array).
func discard(ctx context.Context, pool *pgxpool.Pool, schema string, ids []int64, asJSON bool, stdout, stderr io.Writer) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }() // after a commit, a no-op
	if err := readableText(ctx, tx); err != nil {
		return err
	}
	// A stdout that blocks (a pipe nobody reads) must not keep the
	// transaction, its row locks and the vacuum horizon, for long: past
	// this the server ends it and nothing is discarded.
	if _, err := tx.Exec(ctx, `SELECT set_config('idle_in_transaction_session_timeout', $1, true)`,
		strconv.FormatInt(discardWriteTimeout.Milliseconds(), 10)); err != nil {
		return err
	}
	gone, err := relay.DiscardDead(ctx, tx, schema, ids)
	if err != nil {
		// This transaction rolls back: what DiscardDead deleted before it
		// found an id gone (another process took it at the same moment)
		// is not deleted after all.
		var nf *relay.DeadNotFoundError
		if errors.As(err, &nf) {
			nf.Done = 0
		}
		return fmt.Errorf("discard dead events (nothing was discarded): %w", err)
	}
	var copy bytes.Buffer
	if asJSON {
		if err := printDeadJSON(&copy, gone); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(&copy, "copy of %d dead events to discard, taken before the commit:\n", len(gone))
		for _, d := range gone {
			printDead(&copy, d, true)
		}
	}
	if _, err := stdout.Write(copy.Bytes()); err != nil {
		return fmt.Errorf("print the discarded events (nothing was discarded): %w", err)
	}
	if f, ok := stdout.(*os.File); ok {
		// Written to a file, the copy must be on disk before the events
		// are gone; a pipe or terminal cannot sync (EINVAL).
		if err := f.Sync(); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOTSUP) {
			return fmt.Errorf("print the discarded events (nothing was discarded): %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return discardCommitError(err)
	}
	summary := stdout
	if asJSON {
		summary = stderr
	}
	fmt.Fprintf(summary, "discarded %d dead events\n", len(gone))
	return nil
}

// discardCommitError says what a failed commit of dead discard left. An
// answer from the server (the idle-in-transaction timeout's FATAL, sent
// before COMMIT arrived; COMMIT's own error; a transaction already
// failed) or a COMMIT never sent means nothing was discarded. A connection
// lost after COMMIT was sent leaves the outcome unknown: the server may
// have committed before it went.
func discardCommitError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) || errors.Is(err, pgx.ErrTxCommitRollback) || pgconn.SafeToRetry(err) {
		return fmt.Errorf("commit the discard (nothing was discarded; the copy printed is of events still dead): %w", err)
	}
	return fmt.Errorf("commit the discard (outcome unknown: the connection failed after COMMIT was sent; "+
		"'onceflow dead list' shows whether the events are still there): %w", err)
}

// discardWriteTimeout is how long dead discard's transaction may wait for
// its copy to be written.
var discardWriteTimeout = 10 * time.Second

// idsFlag defines --ids on fs and returns a pointer to its ids, joined:
// each time it is given adds its ids (the flag package would keep only the
// last, and the command act on part of what was asked).
func idsFlag(fs *flag.FlagSet, usage string) *string {
	joined := new(string)
	fs.Func("ids", usage, func(s string) error {
		if *joined != "" {
			s = "," + s
		}
		*joined += s
		return nil
	})
	return joined
}

// parseIDs reads --ids; with all (only allowed when the flag set has --all)
// it returns nil, meaning every dead event. A blank list is an error: only
// --all means all.
func parseIDs(fs *flag.FlagSet, ids string, all bool) ([]int64, error) {
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == "ids" })
	hasAll := fs.Lookup("all") != nil
	switch {
	case all && given:
		return nil, fmt.Errorf("%w: give --ids or --all, not both", errUsage)
	case all:
		return nil, nil
	case !given && hasAll:
		return nil, fmt.Errorf("%w: give --ids (comma-separated dead event ids) or --all", errUsage)
	case !given:
		return nil, fmt.Errorf("%w: --ids is required (comma-separated dead event ids)", errUsage)
	}
	var out []int64
	for _, s := range strings.Split(ids, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		id, err := strconv.ParseInt(s, 10, 64)
		if err != nil || id < 1 {
			return nil, fmt.Errorf("%w: --ids: %q is not a dead event id", errUsage, s)
		}
		out = append(out, id)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: --ids %q names no id", errUsage, ids)
	}
	return out, nil
}

func printDead(w io.Writer, d relay.DeadEvent, full bool) {
	fmt.Fprintf(w, "%d  event %s  topic %s  key %q  %d bytes  attempts %d  dead %s\n    error: %s\n",
		d.ID, d.EventID, d.Topic, d.Key, len(d.Value), d.Attempts, d.DeadAt.Format(time.RFC3339), d.Error)
	if full {
		fmt.Fprintf(w, "    created: %s  outbox id %d\n", d.CreatedAt.Format(time.RFC3339Nano), d.OutboxID)
		if len(d.Headers) > 0 {
			h, _ := json.Marshal(d.Headers)
			fmt.Fprintf(w, "    headers: %s\n", h)
		}
		fmt.Fprintf(w, "    value: %q\n", d.Value)
	}
}

// deadJSON is a dead event as `dead list --json` and `dead discard --json`
// print it.
type deadJSON struct {
	ID          int64             `json:"id"`
	OutboxID    int64             `json:"outbox_id"`
	EventID     string            `json:"event_id"`
	Topic       string            `json:"topic"`
	KeyBase64   []byte            `json:"key_base64"`
	ValueBase64 []byte            `json:"value_base64"`
	Headers     map[string]string `json:"headers"`
	CreatedAt   time.Time         `json:"created_at"`
	Error       string            `json:"error"`
	Attempts    int               `json:"attempts"`
	DeadAt      time.Time         `json:"dead_at"`
}

func printDeadJSON(w io.Writer, dead []relay.DeadEvent) error {
	out := make([]deadJSON, len(dead))
	for i, d := range dead {
		out[i] = deadJSON{d.ID, d.OutboxID, d.EventID, d.Topic, d.Key, d.Value, d.Headers, d.CreatedAt, d.Error, d.Attempts, d.DeadAt}
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

func joinIDs(ids []int64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(s, ",")
}
