package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/onceflow/onceflow/internal/otelenv"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/kafkagopublisher"
	"github.com/onceflow/onceflow/relay/kgopublisher"
	"github.com/onceflow/onceflow/relay/relayprom"
)

const relaySummary = `Publish committed outbox events to Kafka, at least once and in per-key order,
until SIGTERM or SIGINT (then hand shards back and exit 0). Several relays may
run at once: they share the 256 shards between them.

A database that does not answer at start is waited for, with backoff, saying so
(--wait-for-database=false: exit 1 instead); bad credentials or a missing
database exit 1 at once. After start, database and broker outages are logged
and waited out; no event is lost. With --http-addr: /livez (the process and
its loop are alive), /readyz (database and a broker answer), /metrics.`

func runRelay(ctx context.Context, args []string, _, stderr io.Writer) error {
	var c common
	fs := newFlagSet("relay", relaySummary, stderr)
	c.register(fs, true)
	httpAddr := fs.String("http-addr", env("ONCEFLOW_HTTP_ADDR", ""), "serve /metrics, /livez and /readyz here, e.g. :9090; empty: off (env ONCEFLOW_HTTP_ADDR)")
	publisher := fs.String("publisher", env("ONCEFLOW_PUBLISHER", "franz-go"), "Kafka client: franz-go (idempotent producer) or kafka-go (env ONCEFLOW_PUBLISHER)")
	instanceID := fs.String("instance-id", env("ONCEFLOW_INSTANCE_ID", ""), "unique name of this relay; default host-pid-random (env ONCEFLOW_INSTANCE_ID)")
	batchSize := fs.Int("batch-size", envInt("ONCEFLOW_BATCH_SIZE", 1000), "events per publish round (env ONCEFLOW_BATCH_SIZE)")
	batchBytes := fs.Int("batch-bytes", envInt("ONCEFLOW_BATCH_BYTES", 16<<20), "most bytes of keys, values and headers per publish round; a larger event goes alone (env ONCEFLOW_BATCH_BYTES)")
	probe := fs.Duration("probe-interval", envDuration("ONCEFLOW_PROBE_INTERVAL", 5*time.Millisecond), "an idle relay probes the outbox id sequence this often (env ONCEFLOW_PROBE_INTERVAL)")
	poll := fs.Duration("poll-interval", envDuration("ONCEFLOW_POLL_INTERVAL", 250*time.Millisecond), "an idle relay reads its shards at least this often, whatever the probe says (env ONCEFLOW_POLL_INTERVAL)")
	lease := fs.Duration("lease-duration", envDuration("ONCEFLOW_LEASE_DURATION", 6*time.Second), "shard lease; a killed relay's shards move after about this (env ONCEFLOW_LEASE_DURATION)")
	grace := fs.Duration("unknown-topic-grace", envDuration("ONCEFLOW_UNKNOWN_TOPIC_GRACE", time.Minute), "retry an unknown topic this long before dead-lettering (env ONCEFLOW_UNKNOWN_TOPIC_GRACE)")
	waitDB := fs.Bool("wait-for-database", kafkaEnvBoolDefault("ONCEFLOW_WAIT_FOR_DATABASE", true), "at start, wait (with backoff, saying so) for a database that does not answer instead of exiting 1; bad credentials or a missing database still exit 1 (env ONCEFLOW_WAIT_FOR_DATABASE)")
	checkEvery := fs.Duration("kafka-check-interval", envDuration("ONCEFLOW_KAFKA_CHECK_INTERVAL", 5*time.Second), "how often to check a broker answers (logged at Warn and exported as onceflow_relay_kafka_up) (env ONCEFLOW_KAFKA_CHECK_INTERVAL)")
	handoff := fs.Duration("kafka-handoff", envDuration("ONCEFLOW_KAFKA_HANDOFF", time.Minute), "a relay no Kafka broker has answered for this long hands its shards to the relays that reach Kafka, if any does; at least --lease-duration; by default 1m, or --lease-duration if that is longer (env ONCEFLOW_KAFKA_HANDOFF)")
	forbiddenGrace := fs.Duration("topic-forbidden-grace", envDuration("ONCEFLOW_TOPIC_FORBIDDEN_GRACE", time.Minute), "retry a topic that answers \"not authorized\" this long before dead-lettering (env ONCEFLOW_TOPIC_FORBIDDEN_GRACE)")
	var kf kafkaFlags
	kf.register(fs)
	publishTimeout := fs.Duration("publish-timeout", envDuration("ONCEFLOW_PUBLISH_TIMEOUT", 30*time.Second), "wait this long for Kafka's acknowledgements; a record not acknowledged by then is retried beside the other keys, never dead-lettered (env ONCEFLOW_PUBLISH_TIMEOUT)")
	maxHeldKeys := fs.Int("max-held-keys", envInt("ONCEFLOW_MAX_HELD_KEYS", 1024), "most keys held back at once after failed attempts; past it the relay stops reading the failed key's partition from its failed event on until half are out (env ONCEFLOW_MAX_HELD_KEYS)")
	if err := c.parse(ctx, fs, args, true); err != nil {
		return err
	}
	if *maxHeldKeys < 1 {
		return fmt.Errorf("%w: --max-held-keys: %d is not positive", errUsage, *maxHeldKeys)
	}
	// relay.Config takes a zero for "the default": on the command line an
	// explicit 0 is more likely meant as "at once" or "none", which it is
	// not, so it is refused.
	for _, f := range []struct {
		name string
		n    int64
	}{{"batch-size", int64(*batchSize)}, {"batch-bytes", int64(*batchBytes)}} {
		if f.n < 1 {
			return fmt.Errorf("%w: --%s: %d is not positive", errUsage, f.name, f.n)
		}
	}
	for _, f := range []struct {
		name string
		d    time.Duration
	}{{"probe-interval", *probe}, {"poll-interval", *poll}, {"lease-duration", *lease}, {"unknown-topic-grace", *grace},
		{"topic-forbidden-grace", *forbiddenGrace}, {"publish-timeout", *publishTimeout}, {"kafka-handoff", *handoff}} {
		if f.d <= 0 {
			return fmt.Errorf("%w: --%s: %s is not positive", errUsage, f.name, f.d)
		}
	}
	if err := kf.check(); err != nil {
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	// Not given (by flag or variable): the relay's default, a minute or
	// the lease if that is longer, so that --lease-duration 2m alone is
	// not refused over a flag the operator never typed.
	handoffGiven := os.Getenv("ONCEFLOW_KAFKA_HANDOFF") != ""
	fs.Visit(func(f *flag.Flag) { handoffGiven = handoffGiven || f.Name == "kafka-handoff" })
	if !handoffGiven {
		*handoff = 0
	}
	brokers, conn, err := kf.conn(c.brokerList())
	if err != nil {
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if *publisher != "franz-go" && *publisher != "kafka-go" {
		return fmt.Errorf("%w: --publisher: %q is not franz-go or kafka-go", errUsage, *publisher)
	}
	// A round's records wait out the linger before they are sent: one the
	// publish timeout cannot cover times every round out.
	if kf.linger >= *publishTimeout {
		return fmt.Errorf("%w: --linger: %s is not shorter than --publish-timeout (%s)", errUsage, kf.linger, *publishTimeout)
	}
	if *publisher == "franz-go" && kf.linger > time.Minute {
		return fmt.Errorf("%w: --linger: %s is longer than franz-go allows (%s)", errUsage, kf.linger, time.Minute)
	}

	if *checkEvery <= 0 {
		return fmt.Errorf("%w: --kafka-check-interval: %s is not positive", errUsage, *checkEvery)
	}
	if *httpAddr != "" {
		// Malformed is bad input; a port in use is found at listen (exit 1).
		_, port, err := net.SplitHostPort(*httpAddr)
		if err != nil {
			return fmt.Errorf("%w: --http-addr: %q is not host:port (e.g. :9090): %v", errUsage, *httpAddr, err)
		}
		if n, err := strconv.Atoi(port); err == nil && (n < 0 || n > 65535) {
			return fmt.Errorf("%w: --http-addr: port %d is not between 0 and 65535", errUsage, n)
		}
	}
	// Every line carries instance=, the first ones (the database wait, the
	// broker check) included, so the id is settled before anything logs.
	if *instanceID == "" {
		*instanceID = relay.DefaultInstanceID()
	}
	base, _ := c.logger(stderr)
	log := base.With("instance", *instanceID)
	for _, msg := range unknownEnv(os.Environ()) {
		log.Warn(msg)
	}

	backends := &backendPIDs{} // for /livez: does a session wait on a lock?
	pool, err := openWith(ctx, func() (*pgxpool.Config, error) {
		cfg, err := c.poolConfig()
		if err == nil {
			backends.install(cfg)
		}
		return cfg, err
	})
	if err != nil {
		return err
	}
	defer pool.Close()

	var pub relay.Publisher
	if *publisher == "kafka-go" {
		pub, err = kafkagopublisher.New(brokers, &kafkagopublisher.Config{Conn: conn, Compression: kf.compression, BatchBytes: int64(kf.maxRecordBytes), BatchTimeout: kf.linger})
	} else {
		pub, err = kgopublisher.New(brokers, &kgopublisher.Config{Conn: conn, Compression: kf.compression, MaxRecordBytes: int32(kf.maxRecordBytes), Linger: kf.linger})
	}
	if err != nil {
		return err
	}
	defer pub.Close()

	reg := prometheus.NewRegistry()
	// Traces go out over OTLP when the OTEL_* variables ask for it.
	tp, stopTracing, err := otelenv.Setup(ctx, "onceflow-relay", func(w string) { log.Warn("relay: tracing: " + w) })
	if err != nil {
		return err
	}
	defer stopTracing()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	reg.MustRegister(buildInfoGauge())
	watch := newBrokerWatch(pub, log, reg, *checkEvery)
	r, err := relay.New(pool, watch, &relay.Config{
		Schema:              c.schema,
		InstanceID:          *instanceID,
		BatchSize:           *batchSize,
		BatchBytes:          *batchBytes,
		ProbeInterval:       *probe,
		PollInterval:        *poll,
		LeaseDuration:       *lease,
		UnknownTopicGrace:   *grace,
		PublishTimeout:      *publishTimeout,
		TopicForbiddenGrace: *forbiddenGrace,
		KafkaHandoff:        *handoff,
		MaxHeldKeys:         *maxHeldKeys,
		Logger:              base, // the relay adds instance= itself
		Observer:            withTracing(relayprom.NewObserver(reg), tp),
	})
	if err != nil {
		return fmt.Errorf("%w: %v", errUsage, relayFlagNames(err.Error()))
	}
	// Each relay reports the backlog of the shards it owns: a sum across
	// relays is the whole.
	reg.MustRegister(relayprom.NewBacklogCollector(pool, c.schema, &relayprom.CollectorConfig{Owned: r.OwnedShards, Logger: log}))

	pr := &probes{pool: pool, watch: watch, stallAt: 2*time.Minute + 4**poll, backends: backends, schema: c.schema}
	if *httpAddr != "" {
		ln, err := net.Listen("tcp", *httpAddr)
		if err != nil {
			return fmt.Errorf("--http-addr: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		pr.register(mux)
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("http server stopped", "error", err)
			}
		}()
		defer srv.Close()
		log.Info("serving /metrics, /livez and /readyz", "addr", ln.Addr().String())
	}
	log.Info("relay starting", "publisher", *publisher, "brokers", strings.Join(brokers, ","), "kafka", conn.String(), "schema", c.schema, "pid", os.Getpid())
	warnWeakKafkaSecurity(log, conn)
	if conn.SASL != nil && conn.SASL.AWSCredentials != nil {
		// Without credentials every broker connection fails; the broker
		// check says so at Warn, but not why. Say it once, at start, and
		// go on: a role may be a moment from ready (a node booting).
		credCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		if _, err := conn.SASL.AWSCredentials(credCtx); err != nil && ctx.Err() == nil {
			log.Error("relay: no AWS credentials for AWS_MSK_IAM yet; no broker connection can succeed until there are", "error", err)
		}
		cancel()
	}
	watchCtx, stopWatch := context.WithCancel(ctx)
	watchDone := make(chan struct{})
	go func() { defer close(watchDone); watch.run(watchCtx) }()
	defer func() { stopWatch(); <-watchDone }()
	if err := waitForDatabase(ctx, pool, log, *waitDB); err != nil {
		if ctx.Err() != nil {
			return nil // stopped while waiting: nothing was started
		}
		return err
	}
	pr.relay.Store(r)
	return r.Run(ctx)
}

// relayFlagNames renames relay.Config's fields in an error as the flags
// that set them: the operator typed the flag.
func relayFlagNames(s string) string {
	return strings.NewReplacer(
		"relay: Config.Schema", "--schema",
		"relay: Config.InstanceID", "--instance-id",
		"relay: Config.BatchSize", "--batch-size",
		"relay: Config.BatchBytes", "--batch-bytes",
		"relay: Config.ProbeInterval", "--probe-interval",
		"relay: Config.PollInterval", "--poll-interval",
		"relay: Config.LeaseDuration", "--lease-duration",
		"relay: Config.UnknownTopicGrace", "--unknown-topic-grace",
		"relay: Config.TopicForbiddenGrace", "--topic-forbidden-grace",
		"relay: Config.PublishTimeout", "--publish-timeout",
		"relay: Config.KafkaHandoff", "--kafka-handoff",
		"at least Config.LeaseDuration", "at least --lease-duration",
		"relay: Config.MaxHeldKeys", "--max-held-keys",
	).Replace(s)
}
