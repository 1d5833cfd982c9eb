package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	embeddedpostgres "github.com/fergusstrange/embedded-postgres"
)

// The demo's last fallback for a database: PostgreSQL from the
// io.zonky.test.postgres server binaries on Maven Central, fetched by
// github.com/fergusstrange/embedded-postgres on first use and cached. It runs
// in a child process (`onceflow demo-postgres`), as user nobody when the demo
// runs as root (initdb refuses root), in a temporary directory removed at
// the end.

// startEmbeddedPostgres starts the child and returns its URL and a function
// that stops it and removes its files.
func startEmbeddedPostgres(ctx context.Context, stdout io.Writer) (string, func(), error) {
	dir, err := os.MkdirTemp("", "onceflow-demo-pg-")
	if err != nil {
		return "", nil, err
	}
	cleanup := func() { _ = os.RemoveAll(dir) }
	cache, err := embeddedCacheDir()
	if err != nil {
		cleanup()
		return "", nil, err
	}
	cached, _ := filepath.Glob(filepath.Join(cache, "*.txz"))
	self, err := os.Executable()
	if err != nil {
		cleanup()
		return "", nil, err
	}
	port, err := freePort()
	if err != nil {
		cleanup()
		return "", nil, err
	}
	var attr *syscall.SysProcAttr
	if os.Geteuid() == 0 {
		// initdb refuses to run as root: run the server as nobody, from a
		// copy of this binary nobody can read (go run's lives under /root).
		uid, gid, err := lookupUser("nobody")
		if err != nil {
			cleanup()
			return "", nil, fmt.Errorf("running as root, the embedded PostgreSQL needs an unprivileged user: %w", err)
		}
		copyPath := filepath.Join(dir, "onceflow")
		if err := copyFile(self, copyPath, 0o755); err != nil {
			cleanup()
			return "", nil, err
		}
		self = copyPath
		for _, d := range []string{dir, cache} {
			if err := chownTree(d, uid, gid); err != nil {
				cleanup()
				return "", nil, err
			}
		}
		attr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid}}
	}
	if len(cached) == 0 {
		fmt.Fprintf(stdout, "0. starting an embedded PostgreSQL: downloading its binaries from Maven Central once (cached in %s)\n", cache)
	} else {
		fmt.Fprintf(stdout, "0. starting an embedded PostgreSQL (binaries cached in %s)\n", cache)
	}
	cmd := exec.Command(self, "demo-postgres", "--dir", dir, "--cache", cache, "--port", strconv.Itoa(port))
	cmd.Env = demoEnv("HOME=" + dir)
	cmd.SysProcAttr = attr
	cmd.Stderr = io.Discard
	stdin, err := cmd.StdinPipe()
	if err != nil {
		cleanup()
		return "", nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		cleanup()
		return "", nil, err
	}
	if err := cmd.Start(); err != nil {
		cleanup()
		return "", nil, fmt.Errorf("start the embedded PostgreSQL: %w", err)
	}
	stop := func() {
		_ = stdin.Close() // the child stops the server when its stdin closes
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		cleanup()
	}
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		var last string
		for sc.Scan() {
			last = sc.Text()
			if last == "ready" {
				ready <- ""
				break
			}
		}
		if last != "ready" {
			if last == "" {
				last = "it exited without a word"
			}
			ready <- last
		}
		_, _ = io.Copy(io.Discard, out)
	}()
	select {
	case msg := <-ready:
		if msg != "" {
			stop()
			return "", nil, errors.New(msg)
		}
	case <-time.After(10 * time.Minute):
		stop()
		return "", nil, errors.New("not ready within 10 minutes")
	case <-ctx.Done():
		stop()
		return "", nil, ctx.Err()
	}
	u := url.URL{Scheme: "postgres", User: url.UserPassword("postgres", "postgres"), Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), Path: "/postgres", RawQuery: "sslmode=disable"}
	return u.String(), stop, nil
}

// runDemoPostgres is the child: it starts the server, prints "ready" (or
// one line saying why not) and stops it when stdin closes or a signal
// arrives.
func runDemoPostgres(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("demo-postgres", "Internal: the embedded PostgreSQL of 'onceflow demo'.", stderr)
	dir := fs.String("dir", "", "runtime and data directory")
	cache := fs.String("cache", "", "where the downloaded binaries are cached")
	port := fs.Int("port", 0, "port to listen on (127.0.0.1)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dir == "" || *cache == "" || *port <= 0 {
		return fmt.Errorf("%w: --dir, --cache and --port are required", errUsage)
	}
	logFile, err := os.Create(filepath.Join(*dir, "postgres.log"))
	if err != nil {
		fmt.Fprintln(stdout, oneLine(err))
		return err
	}
	defer logFile.Close()
	db := embeddedpostgres.NewDatabase(embeddedpostgres.DefaultConfig().
		Port(uint32(*port)).
		RuntimePath(filepath.Join(*dir, "runtime")).
		DataPath(filepath.Join(*dir, "data")).
		CachePath(*cache).
		StartTimeout(2 * time.Minute).
		StartParameters(map[string]string{"listen_addresses": "127.0.0.1", "max_connections": "100", "fsync": "off"}).
		Logger(logFile))
	if err := db.Start(); err != nil {
		fmt.Fprintln(stdout, oneLine(err))
		return err
	}
	fmt.Fprintln(stdout, "ready")
	stdinClosed := make(chan struct{})
	go func() { _, _ = io.Copy(io.Discard, os.Stdin); close(stdinClosed) }()
	select {
	case <-stdinClosed:
	case <-ctx.Done():
	}
	return db.Stop()
}

// embeddedCacheDir is where the server binaries are kept between runs: the
// user's cache directory, or /var/cache/onceflow for root (whose home the
// unprivileged server user cannot read).
func embeddedCacheDir() (string, error) {
	base := "/var/cache"
	if os.Geteuid() != 0 {
		var err error
		if base, err = os.UserCacheDir(); err != nil {
			base = os.TempDir()
		}
	}
	dir := filepath.Join(base, "onceflow", "embedded-postgres")
	return dir, os.MkdirAll(dir, 0o755)
}

func lookupUser(name string) (uint32, uint32, error) {
	u, err := user.Lookup(name)
	if err != nil {
		return 0, 0, err
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return 0, 0, err
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return 0, 0, err
	}
	return uint32(uid), uint32(gid), nil
}

func chownTree(dir string, uid, gid uint32) error {
	return filepath.WalkDir(dir, func(p string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, int(uid), int(gid))
	})
}

func copyFile(from, to string, mode os.FileMode) error {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// redactURL hides a URL's password.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "the given URL"
	}
	return u.Redacted()
}
