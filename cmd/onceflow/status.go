package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/relay"
)

func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlagSet("status", "Show the backlog, the oldest pending event, dead letters, and the live relays with their shards.", stderr)
	c.register(fs, false)
	asJSON := fs.Bool("json", false, "print one JSON object (for scripts)")
	if err := c.parseAdmin(ctx, fs, args, stderr); err != nil {
		return err
	}
	pool, err := c.connectMigrated(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	var st *relay.Status
	err = readTx(ctx, pool, "", func(tx pgx.Tx) error {
		st, err = relay.ReadStatus(ctx, tx, c.schema)
		return err
	})
	if err != nil {
		return err
	}
	if *asJSON {
		return printStatusJSON(stdout, c.schema, st)
	}
	fmt.Fprintf(stdout, "schema:          %s\n", c.schema)
	fmt.Fprintf(stdout, "backlog:         %d events\n", st.Backlog)
	if st.OldestPending != nil {
		fmt.Fprintf(stdout, "oldest pending:  %s ago (max attempts %d)\n", st.ReadAt.Sub(*st.OldestPending).Round(time.Millisecond), st.MaxAttempts)
	} else {
		fmt.Fprintf(stdout, "oldest pending:  -\n")
	}
	fmt.Fprintf(stdout, "dead letters:    %d (onceflow dead list)\n", st.DeadLetters)
	fmt.Fprintf(stdout, "unowned shards:  %d of %d\n", st.UnownedShards, relay.NumShards)
	fmt.Fprintf(stdout, "relays:\n")
	if len(st.Relays) == 0 {
		fmt.Fprintf(stdout, "  none\n")
	}
	for _, r := range st.Relays {
		// A gone relay (killed: its row is forgotten an hour after its
		// lease lapsed) ran until its last heartbeat; it is not up.
		state, ran := "live", "up "+st.ReadAt.Sub(r.StartedAt).Round(time.Second).String()
		if !r.Live {
			state, ran = "gone", "ran "+r.HeartbeatAt.Sub(r.StartedAt).Round(time.Second).String()
		}
		fmt.Fprintf(stdout, "  %s  %s  host %s pid %d  %s  last heartbeat %s ago  %d shards %s\n",
			r.ID, state, r.Hostname, r.PID, ran,
			st.ReadAt.Sub(r.HeartbeatAt).Round(time.Millisecond), len(r.Shards), shardRanges(r.Shards))
	}
	return nil
}

// shardRanges prints 0-5,9,12-13.
func shardRanges(shards []int16) string {
	out := ""
	for i := 0; i < len(shards); {
		j := i
		for j+1 < len(shards) && shards[j+1] == shards[j]+1 {
			j++
		}
		if out != "" {
			out += ","
		}
		if i == j {
			out += fmt.Sprint(shards[i])
		} else {
			out += fmt.Sprintf("%d-%d", shards[i], shards[j])
		}
		i = j + 1
	}
	return "[" + out + "]"
}

// statusJSON is `onceflow status --json`.
type statusJSON struct {
	Schema          string      `json:"schema"`
	Backlog         int64       `json:"backlog"`
	OldestPendingAt *time.Time  `json:"oldest_pending_at"`
	OldestAgeSecs   *float64    `json:"oldest_pending_age_seconds"`
	MaxAttempts     int         `json:"max_attempts"`
	DeadLetters     int64       `json:"dead_letters"`
	Shards          int         `json:"shards"`
	UnownedShards   int         `json:"unowned_shards"`
	Relays          []relayJSON `json:"relays"`
}

type relayJSON struct {
	ID          string    `json:"id"`
	Live        bool      `json:"live"`
	Hostname    string    `json:"hostname"`
	PID         int       `json:"pid"`
	StartedAt   time.Time `json:"started_at"`
	HeartbeatAt time.Time `json:"heartbeat_at"`
	Shards      []int16   `json:"shards"`
}

func printStatusJSON(w io.Writer, schema string, st *relay.Status) error {
	out := statusJSON{
		Schema: schema, Backlog: st.Backlog, OldestPendingAt: st.OldestPending, MaxAttempts: st.MaxAttempts,
		DeadLetters: st.DeadLetters, Shards: relay.NumShards, UnownedShards: st.UnownedShards, Relays: []relayJSON{},
	}
	if st.OldestPending != nil {
		age := st.ReadAt.Sub(*st.OldestPending).Seconds()
		out.OldestAgeSecs = &age
	}
	for _, r := range st.Relays {
		shards := r.Shards
		if shards == nil {
			shards = []int16{}
		}
		out.Relays = append(out.Relays, relayJSON{r.ID, r.Live, r.Hostname, r.PID, r.StartedAt, r.HeartbeatAt, shards})
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}
