package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
)

// buildInfo is what the binary knows about its own build: the module
// version (set by `go install …@vX.Y.Z`, "(devel)" for a local build) and the
// VCS revision the go command stamped (absent under -buildvcs=false).
type buildInfo struct {
	Version  string
	Revision string
	Time     string
	Modified bool
	Go       string
}

func readBuildInfo() buildInfo {
	b := buildInfo{Version: "(unknown)", Go: runtime.Version()}
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return b
	}
	if info.Main.Version != "" {
		b.Version = info.Main.Version
	}
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			b.Revision = s.Value
		case "vcs.time":
			b.Time = s.Value
		case "vcs.modified":
			b.Modified = s.Value == "true"
		}
	}
	return b
}

func (b buildInfo) String() string {
	s := "onceflow " + b.Version
	if b.Revision != "" {
		s += " (revision " + b.Revision
		if b.Time != "" {
			s += ", " + b.Time
		}
		if b.Modified {
			s += ", modified"
		}
		s += ")"
	}
	return s + fmt.Sprintf(" %s %s/%s", b.Go, runtime.GOOS, runtime.GOARCH)
}

func runVersion(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("version", "Print the module version and VCS revision this binary was built from.", stderr)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected argument %q", errUsage, fs.Arg(0))
	}
	fmt.Fprintln(stdout, readBuildInfo())
	return nil
}

// buildInfoGauge is onceflow_build_info: 1, labelled with the build.
func buildInfoGauge() prometheus.Collector {
	b := readBuildInfo()
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "onceflow_build_info",
		Help:        "Always 1; labelled with the onceflow module version, VCS revision and Go version of this binary.",
		ConstLabels: prometheus.Labels{"version": b.Version, "revision": b.Revision, "goversion": b.Go},
	})
	g.Set(1)
	return g
}
