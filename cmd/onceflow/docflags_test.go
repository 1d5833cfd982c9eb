package main

import (
	"errors"
	"flag"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Every `--flag` the user documentation names is a flag some command takes:
// README's "Roles and privileges" said the relay stops "at its next lease
// tick (a third of `--lease`)", and `onceflow relay --lease 6s` answers
// "flag provided but not defined: -lease" (the flag is --lease-duration).
// Flags of the examples and of scripts/kafka.sh are listed by hand. h97.
func TestDocumentedFlagsExist(t *testing.T) {
	known := map[string]bool{
		// examples/ledger and examples/orders
		"--addr": true, "--group": true, "--topic": true, "--trace": true, "--dedup-window": true,
		"--session-timeout": true, "--rebalance-timeout": true,
		// scripts/kafka.sh; the help flag; "any --kafka-tls-* flag"
		"--state": true, "--help": true, "--kafka-tls-": true,
	}
	for _, cmd := range [][]string{
		{"relay"}, {"status"}, {"version"}, {"demo"},
		{"migrate", "up"}, {"migrate", "down"}, {"migrate", "status"}, {"migrate", "print"},
		{"dead", "list"}, {"dead", "replay"}, {"dead", "discard"},
	} {
		out, err := runCLI(t, append(cmd, "--help")...)
		if !errors.Is(err, flag.ErrHelp) {
			t.Fatalf("%v --help: %v", cmd, err)
		}
		for _, m := range regexp.MustCompile(`(?m)^\s+-([a-z][a-z0-9-]*)`).FindAllStringSubmatch(out, -1) {
			known["--"+m[1]] = true
		}
	}
	files, _ := filepath.Glob("../../docs/*.md")
	files = append(files, "../../README.md")
	re := regexp.MustCompile("`[^`]*`")
	flagRe := regexp.MustCompile(`(?:^|[\s(=])(--[a-z][a-z0-9-]*)`)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(b), "\n") {
			for _, code := range re.FindAllString(line, -1) {
				for _, m := range flagRe.FindAllStringSubmatch(strings.Trim(code, "`"), -1) {
					if !known[m[1]] {
						t.Errorf("%s:%d: %s is not a flag of any onceflow command", filepath.Base(f), i+1, m[1])
					}
				}
			}
		}
	}
}
