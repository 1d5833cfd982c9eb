// Package deploy holds no Go code: its tests check the Prometheus alert
// rules and the Grafana dashboard in this folder with promtool.
package deploy

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

const (
	rulesFile     = "prometheus/onceflow-rules.yml"
	rulesTestFile = "prometheus/onceflow-rules.test.yml"
	dashboardFile = "grafana/onceflow.json"
)

// promtool finds Prometheus's promtool: $PROMTOOL, else on PATH. CI
// installs it (.ci/run: Debian's prometheus package).
func promtool(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("PROMTOOL"); p != "" {
		return p
	}
	p, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool not found: install it (apt-get install prometheus, or a Prometheus release) or set PROMTOOL")
	}
	return p
}

func run(t *testing.T, dir string, name string, args ...string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", filepath.Base(name), strings.Join(args, " "), err, out)
	}
}

// The alert rules are valid, and each alert has a unit test in which it
// stays quiet, fires, and clears.
func TestAlertRules(t *testing.T) {
	pt := promtool(t)
	run(t, ".", pt, "check", "rules", rulesFile)
	run(t, "prometheus", pt, "test", "rules", filepath.Base(rulesTestFile))

	rules := read(t, rulesFile)
	tests := read(t, rulesTestFile)
	alerts := regexp.MustCompile(`(?m)^\s*- alert: (\w+)$`).FindAllStringSubmatch(rules, -1)
	if len(alerts) < 8 {
		t.Fatalf("%d alerts in %s, want the full set", len(alerts), rulesFile)
	}
	for _, a := range alerts {
		name := regexp.QuoteMeta(a[1])
		fires := regexp.MustCompile(`alertname: ` + name + `\n\s+exp_alerts:\n\s+- exp_labels:`)
		quiet := regexp.MustCompile(`alertname: ` + name + `, exp_alerts: \[\]`)
		if !fires.MatchString(tests) {
			t.Errorf("alert %s: no test shows it firing", a[1])
		}
		if n := len(quiet.FindAllString(tests, -1)); n < 2 {
			t.Errorf("alert %s: %d quiet checks, want one before it fires and one after it clears", a[1], n)
		}
	}
}

type dashboard struct {
	UID    string  `json:"uid"`
	Title  string  `json:"title"`
	Panels []panel `json:"panels"`
}

type panel struct {
	Type       string `json:"type"`
	Title      string `json:"title"`
	Datasource *struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
}

// DashboardExprs returns every query of the Grafana dashboard.
func dashboardExprs(t *testing.T) []string {
	t.Helper()
	var d dashboard
	if err := json.Unmarshal([]byte(read(t, dashboardFile)), &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	if d.UID == "" || d.Title == "" {
		t.Fatalf("%s: uid and title are required", dashboardFile)
	}
	var exprs []string
	for _, p := range d.Panels {
		if p.Type == "row" {
			continue
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
			t.Errorf("panel %q: datasource must be the ${datasource} variable", p.Title)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, q := range p.Targets {
			exprs = append(exprs, q.Expr)
		}
	}
	return exprs
}

// Every query of the dashboard is valid PromQL: promtool checks them as
// recording rules, with Grafana's variables filled in.
func TestDashboardQueriesParse(t *testing.T) {
	pt := promtool(t)
	vars := strings.NewReplacer("$__rate_interval", "5m", "$job", ".*", "$consumer", ".*")
	var b strings.Builder
	b.WriteString("groups:\n  - name: dashboard\n    rules:\n")
	for i, e := range dashboardExprs(t) {
		q, _ := json.Marshal(vars.Replace(e)) // a JSON string is a YAML string
		fmt.Fprintf(&b, "      - record: onceflow:dashboard_query_%d\n        expr: %s\n", i, q)
	}
	f := filepath.Join(t.TempDir(), "dashboard-rules.yml")
	if err := os.WriteFile(f, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	run(t, ".", pt, "check", "rules", f)
}

func read(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
