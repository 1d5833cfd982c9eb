// Command onceflow migrates onceflow's schema, runs the outbox relay,
// reports status, manages dead letters and runs a demo.
//
//	onceflow migrate up|down|status|print
//	onceflow relay
//	onceflow status [--json]
//	onceflow dead list|replay|discard
//	onceflow demo
//	onceflow version
//
// Every flag except the demo's can also come from the environment variable
// named in its help. The demo reads only its flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/migrations"
)

const usage = `onceflow: effectively-once effects on PostgreSQL and Kafka.

Usage:
  onceflow migrate up|down|status|print
                                    apply, revert (one step) or list schema migrations,
                                    or print them as SQL for your own migration tool
  onceflow relay                    publish committed outbox events to Kafka until SIGTERM/SIGINT
  onceflow status                   backlog, oldest pending event, dead letters, relays and shards
  onceflow dead list|replay|discard show dead-lettered events, move them back into the outbox,
                                    or delete them for good
  onceflow demo                     run the whole story on this machine, with an embedded Kafka
  onceflow version                  print the version and VCS revision (also --version)

Run 'onceflow COMMAND --help' for a command's flags.
`

// errUsage marks a bad invocation: exit code 2.
var errUsage = errors.New("usage")

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go func() {
		<-ctx.Done()
		stop() // a second signal kills at once, should shutdown hang
	}()
	if code := exitCode(run(ctx, os.Args[1:], os.Stdout, os.Stderr), os.Stderr); code != 0 {
		os.Exit(code)
	}
}

// exitCode writes the error a command ended with, as its last line on
// stderr, and returns the process's exit code: 2 for a bad invocation.
// Under --log-format json the line is a JSON log line, as the command's
// own were: a pipeline parsing stderr as JSON would drop the one line that
// says why the process ended.
func exitCode(err error, stderr io.Writer) int {
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return 0
	}
	code, msg := 1, oneLine(err)
	if errors.Is(err, errUsage) {
		code, msg = 2, strings.TrimPrefix(err.Error(), "usage: ")
	}
	if errors.As(err, new(jsonExit)) {
		log := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{ReplaceAttr: replaceAttr}))
		log.Error("onceflow: exiting", "error", msg, "exit_code", code)
		return code
	}
	fmt.Fprintln(stderr, "onceflow:", msg)
	return code
}

// jsonExit marks the error of a command run under --log-format json.
type jsonExit struct{ err error }

func (e jsonExit) Error() string { return e.err.Error() }
func (e jsonExit) Unwrap() error { return e.err }

// logFormatKey is the context key under which run keeps a *string that a
// command's flag parsing sets to its --log-format.
type logFormatKey struct{}

// noteLogFormat tells run the log format a command's flags chose.
func noteLogFormat(ctx context.Context, format string) {
	if p, ok := ctx.Value(logFormatKey{}).(*string); ok {
		*p = format
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var format string
	err := runCommand(context.WithValue(ctx, logFormatKey{}, &format), args, stdout, stderr)
	if err != nil && format == "json" {
		return jsonExit{err}
	}
	return err
}

func runCommand(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return fmt.Errorf("%w: no command given", errUsage)
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "migrate":
		return runMigrate(ctx, rest, stdout, stderr)
	case "relay":
		return runRelay(ctx, rest, stdout, stderr)
	case "status":
		return runStatus(ctx, rest, stdout, stderr)
	case "dead":
		return runDead(ctx, rest, stdout, stderr)
	case "demo":
		return runDemo(ctx, rest, stdout, stderr)
	case "demo-consumer": // internal: a consumer process of the demo
		return runDemoConsumer(ctx, rest, stdout, stderr)
	case "demo-postgres": // internal: the demo's embedded PostgreSQL
		return runDemoPostgres(ctx, rest, stdout, stderr)
	case "version", "--version":
		return runVersion(rest, stdout, stderr)
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	default:
		fmt.Fprint(stderr, usage)
		return fmt.Errorf("%w: unknown command %q", errUsage, cmd)
	}
}

// common are the flags every command shares.
type common struct {
	databaseURL string
	// passwordFile and poolSize: see pgflags.go.
	passwordFile string
	poolSize     int
	schema       string
	brokers      string
	takesBrokers bool // the command has --brokers (ONCEFLOW_BROKERS applies)
	logLevel     string
	logFormat    string
}

// env reads a text setting. An empty variable counts as unset, as it does
// for numbers, durations and booleans: a deployment template substituting a
// variable nobody set passes an empty value, which means "the default".
func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

// envErrs collects environment values that do not parse (*badEnv),
// reported by parse as a usage error rather than silently replaced by the
// default, unless the flag the variable stands for is given.
var envErrs []error

// badEnv is an environment value that does not parse.
type badEnv struct {
	name, value, want string
}

func (e *badEnv) Error() string { return fmt.Sprintf("%s=%q is not %s", e.name, e.value, e.want) }

// firstEnvError returns the first of envErrs whose flag was not given on
// the command line: a flag given wins over its variable, bad or not.
func firstEnvError(fs *flag.FlagSet) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for _, err := range envErrs {
		var e *badEnv
		if errors.As(err, &e) && given[flagOfEnv(fs, e.name)] {
			continue
		}
		return err
	}
	return nil
}

// flagOfEnv names the flag of fs whose usage says it reads the variable
// name ("(env NAME)"), or "".
func flagOfEnv(fs *flag.FlagSet, name string) string {
	found := ""
	fs.VisitAll(func(f *flag.Flag) {
		i := strings.Index(f.Usage, "env "+name)
		if i < 0 {
			return
		}
		if end := i + len("env "+name); end == len(f.Usage) || !strings.ContainsRune("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_", rune(f.Usage[end])) {
			found = f.Name
		}
	})
	return found
}

func envDuration(name string, fallback time.Duration) time.Duration {
	v, ok := os.LookupEnv(name)
	if !ok || v == "" {
		return fallback
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		envErrs = append(envErrs, &badEnv{name, v, "a duration (e.g. 500ms, 6s, 1m)"})
		return fallback
	}
	return d
}

func envInt(name string, fallback int) int {
	v, ok := os.LookupEnv(name)
	if !ok || v == "" {
		return fallback
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		envErrs = append(envErrs, &badEnv{name, v, "a whole number"})
		return fallback
	}
	return n
}

func newFlagSet(name, summary string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("onceflow "+name, flag.ContinueOnError)
	// A parse error is returned, and main prints it as the one line bad
	// input gets: the flag package's own copy of it (written here first)
	// and the flag list after it are not printed. --help prints the list.
	parseErr := &seenWriter{}
	fs.SetOutput(parseErr)
	fs.Usage = func() {
		if parseErr.seen {
			return
		}
		fmt.Fprintf(stderr, "Usage: onceflow %s\n\n%s\n\nFlags:\n", name, summary)
		fs.SetOutput(stderr)
		fs.PrintDefaults()
		fs.SetOutput(parseErr)
	}
	return fs
}

// seenWriter discards what is written and notes that something was.
type seenWriter struct{ seen bool }

func (w *seenWriter) Write(p []byte) (int, error) {
	w.seen = true
	return len(p), nil
}

func (c *common) register(fs *flag.FlagSet, withBrokers bool) {
	// No default from the environment: --help prints a flag's default, and
	// the URL may hold the password. parse reads the variable.
	fs.StringVar(&c.databaseURL, "database-url", "", "PostgreSQL URL (env ONCEFLOW_DATABASE_URL)")
	fs.StringVar(&c.schema, "schema", env("ONCEFLOW_SCHEMA", migrations.DefaultSchema), "schema holding onceflow's tables (env ONCEFLOW_SCHEMA)")
	c.registerPG(fs)
	if withBrokers {
		// No default from the environment either: a broker list may carry
		// credentials (refused, but --help would print them). parse reads it.
		fs.StringVar(&c.brokers, "brokers", "", "Kafka brokers, comma-separated host:port (env ONCEFLOW_BROKERS)")
		c.takesBrokers = true
	}
	fs.StringVar(&c.logLevel, "log-level", env("ONCEFLOW_LOG_LEVEL", "info"), "debug, info, warn or error (env ONCEFLOW_LOG_LEVEL)")
	fs.StringVar(&c.logFormat, "log-format", env("ONCEFLOW_LOG_FORMAT", "text"), "text or json (env ONCEFLOW_LOG_FORMAT)")
}

// parse parses args and checks the common flags.
func (c *common) parse(ctx context.Context, fs *flag.FlagSet, args []string, needBrokers bool) error {
	err := fs.Parse(args)
	noteLogFormat(ctx, c.logFormat) // as far as the flags were read
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected argument %q", errUsage, fs.Arg(0))
	}
	if err := firstEnvError(fs); err != nil {
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if c.databaseURL == "" {
		c.databaseURL = env("ONCEFLOW_DATABASE_URL", "")
	}
	if c.databaseURL == "" {
		return fmt.Errorf("%w: --database-url (or ONCEFLOW_DATABASE_URL) is required", errUsage)
	}
	if _, err := pgxpool.ParseConfig(c.databaseURL); err != nil {
		return fmt.Errorf("%w: %v", errUsage, oneLine(parseURLError(err)))
	}
	if err := migrations.ValidateSchema(c.schema); err != nil {
		return fmt.Errorf("%w: --schema: %v", errUsage, err)
	}
	if c.poolSize < 0 || c.poolSize > 10000 {
		return fmt.Errorf("%w: --database-pool-size: %d is not between 0 and 10000", errUsage, c.poolSize)
	}
	if c.takesBrokers && c.brokers == "" {
		c.brokers = env("ONCEFLOW_BROKERS", "")
	}
	if needBrokers && len(c.brokerList()) == 0 {
		return fmt.Errorf("%w: --brokers (or ONCEFLOW_BROKERS) is required", errUsage)
	}
	for _, b := range c.brokerList() {
		if !strings.Contains(b, ":") {
			if at := strings.LastIndex(b, "@"); at >= 0 {
				b = "…@" + b[at+1:] // credentials, not repeated
			}
			return fmt.Errorf("%w: --brokers: %q is not host:port", errUsage, b)
		}
	}
	if _, err := c.logger(io.Discard); err != nil {
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	return nil
}

// parseAdmin is parse for the commands that do not log (status, dead,
// migrate): it also warns of ONCEFLOW_ variables the binary does not read
// (the relay logs them at start instead; the demo reads no variables),
// after the flags are read, so in --log-format and --log-level, and before
// a usage error, which a mistyped ONCEFLOW_DATABASE_URL causes.
func (c *common) parseAdmin(ctx context.Context, fs *flag.FlagSet, args []string, stderr io.Writer) error {
	err := c.parse(ctx, fs, args, false)
	if !errors.Is(err, flag.ErrHelp) {
		warnUnknownEnv(stderr, c.logFormat, c.logLevel)
	}
	return err
}

func (c *common) brokerList() []string {
	var out []string
	for _, b := range strings.Split(c.brokers, ",") {
		if b = strings.TrimSpace(b); b != "" {
			out = append(out, b)
		}
	}
	return out
}

func (c *common) logger(w io.Writer) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.logLevel)); err != nil {
		return nil, fmt.Errorf("--log-level: %q is not debug, info, warn or error", c.logLevel)
	}
	opts := &slog.HandlerOptions{Level: level, ReplaceAttr: replaceAttr}
	switch c.logFormat {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	default:
		return nil, fmt.Errorf("--log-format: %q is not text or json", c.logFormat)
	}
}

// replaceAttr keeps log lines readable: a duration is written as text
// ("1.5s"; slog's JSON handler would write nanoseconds), and an error as
// one line (pgx joins a connection's failures with "\n\t", which text logs
// would show as escapes and log shippers may split).
func replaceAttr(_ []string, a slog.Attr) slog.Attr {
	switch a.Value.Kind() {
	case slog.KindDuration:
		return slog.String(a.Key, a.Value.Duration().String())
	case slog.KindAny:
		if err, ok := a.Value.Any().(error); ok {
			return slog.String(a.Key, flatten(err.Error()))
		}
	}
	return a
}

// flatten joins the lines of a multi-line message: "a:\n\tb\n\tc" becomes
// "a: b; c".
func flatten(s string) string {
	if !strings.ContainsAny(s, "\r\n") {
		return s
	}
	var b strings.Builder
	for _, line := range strings.FieldsFunc(s, func(r rune) bool { return r == '\n' || r == '\r' }) {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		if b.Len() > 0 {
			if strings.HasSuffix(b.String(), ":") {
				b.WriteString(" ")
			} else {
				b.WriteString("; ")
			}
		}
		b.WriteString(line)
	}
	return b.String()
}

// connect opens a pool and checks the database answers, so a bad URL or a
// database that is down fails at start with one line.
func (c *common) connect(ctx context.Context) (*pgxpool.Pool, error) {
	return c.connectWith(ctx, c.poolConfig)
}

// connectAdmin is connect for the commands that run a few statements and
// exit (migrate, status, dead). Prepared and cached statements gain them
// nothing, and behind a pooler in transaction mode they fail (the server
// connection of the next transaction has other statements: SQLSTATE 42P05
// or 26000), so unless the URL names a mode other than pgx's default they
// use the exec mode, which works through any pooler.
func (c *common) connectAdmin(ctx context.Context) (*pgxpool.Pool, error) {
	return c.connectWith(ctx, func() (*pgxpool.Config, error) {
		cfg, err := c.poolConfig()
		if err == nil && cfg.ConnConfig.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement {
			cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
		}
		return cfg, err
	})
}

func (c *common) connectWith(ctx context.Context, config func() (*pgxpool.Config, error)) (*pgxpool.Pool, error) {
	pool, err := openWith(ctx, config)
	if err != nil {
		return nil, err
	}
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pingCtx); err != nil {
		pool.Close()
		cfg := pool.Config().ConnConfig
		return nil, fmt.Errorf("connect to database %s@%s:%d/%s: %w", cfg.User, cfg.Host, cfg.Port, cfg.Database, err)
	}
	return pool, nil
}

// readableText has the rest of tx's results written in the text forms pgx
// reads: bytea in hex, timestamps in ISO. In the exec and simple_protocol
// modes (connectAdmin's default) results come as text, and a database or
// role may set bytea_output = 'escape' or a DateStyle of SQL, German or
// Postgres (a legacy application's); then reading a dead event or a
// timestamp failed with "invalid hex format" or "invalid PostgreSQL
// date/time value". Set for the transaction only (set_config's is_local),
// which a pooler in transaction mode keeps on one server connection, and
// which ends with it (a session SET would stay on the pooler's server
// connection for its next client, and PgBouncer refuses bytea_output as a
// start-up parameter).
func readableText(ctx context.Context, tx pgx.Tx) error {
	if _, err := tx.Exec(ctx, `SELECT set_config('bytea_output', 'hex', true), set_config('DateStyle', 'ISO', true)`); err != nil {
		return fmt.Errorf("set bytea_output and DateStyle for the transaction: %w", err)
	}
	return nil
}

// readTx runs fn in a read-only transaction of pool's whose results pgx
// reads whatever the database's bytea_output and DateStyle (readableText);
// iso "" is the server's default isolation.
func readTx(ctx context.Context, pool *pgxpool.Pool, iso pgx.TxIsoLevel, fn func(tx pgx.Tx) error) error {
	return pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: iso, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if err := readableText(ctx, tx); err != nil {
			return err
		}
		return fn(tx)
	})
}

// connectMigrated is connect for the commands that read onceflow's tables:
// a schema missing a migration (never migrated: a typo in the schema's name)
// is said so, with what to run, rather than as a missing relation.
func (c *common) connectMigrated(ctx context.Context) (*pgxpool.Pool, error) {
	pool, err := c.connectAdmin(ctx)
	if err != nil {
		return nil, err
	}
	if err := migrations.Check(ctx, pool, c.schema); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// openWith returns a pool of config's without waiting for the database: pgxpool connects
// on first use.
func openWith(ctx context.Context, config func() (*pgxpool.Config, error)) (*pgxpool.Pool, error) {
	cfg, err := config()
	if err != nil {
		return nil, err
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to database: %w", err)
	}
	return pool, nil
}

func (c *common) poolConfig() (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(c.databaseURL)
	if err != nil {
		return nil, parseURLError(err)
	}
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "onceflow"
	}
	if err := c.applyPG(cfg); err != nil {
		return nil, err
	}
	return cfg, nil
}

func oneLine(err error) string {
	return strings.Join(strings.Fields(err.Error()), " ")
}

func subcommand(args []string, allowed ...string) (string, []string, error) {
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help") {
			return "", nil, flag.ErrHelp
		}
		return "", nil, fmt.Errorf("%w: want one of %s", errUsage, strings.Join(allowed, ", "))
	}
	for _, a := range allowed {
		if args[0] == a {
			return a, args[1:], nil
		}
	}
	return "", nil, fmt.Errorf("%w: %q is not one of %s", errUsage, args[0], strings.Join(allowed, ", "))
}
