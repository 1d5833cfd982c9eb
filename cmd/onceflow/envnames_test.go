package main

import (
	"context"
	"errors"
	"flag"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/internal/proctest"
)

// A mistyped variable is named, with the one it most likely meant. Before,
// ONCEFLOW_HTTP_ADRR=:9999 started a relay with no /metrics and said
// nothing (helper 86); the RelaysAbsent alert was the first sign.
func TestAMistypedVariableIsNamed(t *testing.T) {
	schema := pgtest.Schema(t)
	url := pgtest.URL(t)
	t.Setenv("ONCEFLOW_HTTP_ADRR", ":9999")
	t.Setenv("ONCEFLOW_TEST_SOMETHING", "x") // the tests' own: left alone

	for _, cmd := range [][]string{{"status"}, {"migrate", "status"}, {"dead", "list"}} {
		out, err := runCLI(t, append(cmd, "--database-url", url, "--schema", schema)...)
		if err != nil {
			t.Fatalf("%v: %v\n%s", cmd, err, out)
		}
		want := "ONCEFLOW_HTTP_ADRR is set, but onceflow reads no such variable: it is ignored (did you mean ONCEFLOW_HTTP_ADDR?)"
		if !strings.Contains(out, want) {
			t.Errorf("%v's output does not warn of the mistyped variable; want %q in:\n%s", cmd, want, out)
		}
		if strings.Contains(out, "ONCEFLOW_TEST_SOMETHING") {
			t.Errorf("%v warns of a test harness variable:\n%s", cmd, out)
		}
	}

	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	var log proctest.Buffer
	err = run(ctx, []string{"relay", "--database-url", url, "--schema", schema, "--brokers", strings.Join(c.ListenAddrs(), ",")}, &log, &log)
	if err != nil && !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("relay: %v\n%s", err, log.String())
	}
	if !strings.Contains(log.String(), "ONCEFLOW_HTTP_ADRR is set") || !strings.Contains(log.String(), "level=WARN") {
		t.Errorf("the relay does not log the mistyped variable at Warn:\n%s", log.String())
	}
}

// envNames names every variable a flag's help says it reads, and nothing
// else but the password, which has no flag.
func TestEnvNamesMatchTheHelp(t *testing.T) {
	if !slices.IsSorted(envNames) {
		t.Fatal("envNames is not sorted (unknownEnv searches it)")
	}
	inHelp := map[string]bool{}
	re := regexp.MustCompile(`env (ONCEFLOW_[A-Z0-9_]+)`)
	for _, cmd := range [][]string{
		{"relay"}, {"status"},
		{"migrate", "up"}, {"migrate", "down"}, {"migrate", "status"}, {"migrate", "print"},
		{"dead", "list"}, {"dead", "replay"}, {"dead", "discard"},
	} {
		out, err := runCLI(t, append(cmd, "--help")...)
		if !errors.Is(err, flag.ErrHelp) {
			t.Fatalf("%v --help: %v", cmd, err)
		}
		for _, m := range re.FindAllStringSubmatch(out, -1) {
			inHelp[m[1]] = true
		}
	}
	for name := range inHelp {
		if _, found := slices.BinarySearch(envNames, name); !found {
			t.Errorf("%s is read by a flag but missing from envNames: it would be warned of as unknown", name)
		}
	}
	for _, name := range envNames {
		if !inHelp[name] && name != "ONCEFLOW_KAFKA_SASL_PASSWORD" {
			t.Errorf("envNames has %s, which no flag's help names", name)
		}
	}
}
