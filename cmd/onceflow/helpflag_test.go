package main

import (
	"errors"
	"flag"
	"strings"
	"testing"
)

// TestEveryCommandsHelpExitsZero: --help prints the command's usage and is
// not an error (main exits 0 for flag.ErrHelp). `version --help` wrapped
// ErrHelp as a usage error: it printed "onceflow: flag: help requested"
// and exited 2.
func TestEveryCommandsHelpExitsZero(t *testing.T) {
	for _, cmd := range [][]string{
		{"relay"}, {"status"}, {"version"}, {"demo"},
		{"migrate", "up"}, {"migrate", "down"}, {"migrate", "status"}, {"migrate", "print"},
		{"dead", "list"}, {"dead", "replay"}, {"dead", "discard"},
	} {
		out, err := runCLI(t, append(cmd, "--help")...)
		if !errors.Is(err, flag.ErrHelp) || !strings.Contains(out, "Usage") {
			t.Errorf("%s --help: err %v (want flag.ErrHelp: exit 0), output:\n%.200s", strings.Join(cmd, " "), err, out)
		}
	}
}
