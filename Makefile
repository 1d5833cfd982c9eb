# The targets CI runs (.ci/run calls `make services`, `make test`: vet, gofmt,
# staticcheck, go test -race on kfake, and `make test-kafka`: the Kafka-facing
# suites against a real Apache Kafka broker started by scripts/kafka.sh).
GO ?= go

.PHONY: test check vet fmt-check staticcheck race bench bench-quick demo services services-stop kafka-start kafka-stop test-kafka

test: check race

check: vet fmt-check staticcheck

STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2

staticcheck:
	$(GO) run $(STATICCHECK) ./...

vet:
	$(GO) vet ./...

fmt-check:
	@out="$$(gofmt -l . )"; if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

race:
	$(GO) test -race -count=1 -timeout 14m ./...

# Every benchmark at the sizes issue 10's table names (BENCHMARKS.md, "Relay
# under production shapes"): producer overhead at 1/8/16/32 writers, the
# drain at 100k/300k/1M/3M for the naive loop, one relay and four relay
# processes (the 3M/100k ratio is the "here / at the first backlog" line),
# the stuck key, the claim at 1M, commit→Kafka latency, the idle relay, the
# consumer's modes against raw PostgreSQL and the /metrics scrape at 1M and
# 10M, one package at a time (-p 1: benchmarks of two packages must not
# share the cores). About 15-20 minutes on the project's 2-core VM; stop the Java broker
# first (make kafka-stop): it is not used and takes a core's share.
BENCH_DRAIN ?= 100000,300000,1000000,3000000
BENCH_SCRAPE ?= 1000000,10000000
BENCH_PACKAGES = ./relay/ ./relay/relayprom/ ./consumer/ ./idempotency/ ./otelonceflow/

bench:
	ONCEFLOW_BENCH_DRAIN=$(BENCH_DRAIN) ONCEFLOW_BENCH_SCRAPE=$(BENCH_SCRAPE) \
		$(GO) test -run '^$$' -p 1 -bench . -benchtime 1x -timeout 150m $(BENCH_PACKAGES)
	scripts/producer-pgbench.sh

# The same benchmarks at their small default sizes (300k drain, 100k
# scrape): a few minutes, for checking a change before the full run.
bench-quick:
	$(GO) test -run '^$$' -p 1 -bench . -benchtime 1x -timeout 60m $(BENCH_PACKAGES)

demo:
	$(GO) run ./cmd/onceflow demo

# PostgreSQL (installed and started if needed), a real Apache Kafka broker
# (scripts/kafka.sh: Maven-resolved jars, PLAINTEXT/SSL/SASL_SSL listeners)
# and PgBouncer in front of PostgreSQL (scripts/pgbouncer.sh).
services:
	scripts/postgres.sh
	scripts/kafka.sh start >/dev/null
	scripts/pgbouncer.sh start >/dev/null
	@echo "services: PostgreSQL on 127.0.0.1:5432; Kafka env: eval \"\$$(scripts/kafka.sh env)\"; PgBouncer env: eval \"\$$(scripts/pgbouncer.sh env)\""

services-stop: kafka-stop pgbouncer-stop

kafka-start:
	scripts/kafka.sh start

kafka-stop:
	scripts/kafka.sh stop

# The Kafka-facing suites against the real broker: both publishers'
# conformance, both consumer adapters' conformance, the relay crash test,
# relay's sick-partition test (a partition below min.insync.replicas),
# internal/e2e (and the broker-kill tests, which start their own broker with
# scripts/kafka.sh --state DIR), the listener and TLS/SASL tests (kafkaconn).
# Starts the broker if it
# is not running; ONCEFLOW_TEST_KAFKA_BROKERS already set (a cluster of your
# own) is used as it is.
KAFKA_PKGS ?= ./internal/kafkatest/ ./kafkaconn/ ./relay/kgopublisher/ ./relay/kafkagopublisher/ \
	./consumer/kgoconsumer/ ./consumer/kafkagoconsumer/ ./cmd/onceflow/ ./internal/e2e/
KAFKA_RUN ?= .
# From ./relay/ (whose other tests run on kfake in make test) only the
# real-broker tests.
KAFKA_RELAY_RUN ?= OnARealBroker

test-kafka:
	GO=$(GO) KAFKA_RUN='$(KAFKA_RUN)' scripts/test-kafka.sh $(KAFKA_PKGS)
	GO=$(GO) KAFKA_RUN='$(KAFKA_RELAY_RUN)' scripts/test-kafka.sh ./relay/

# PgBouncer (Debian's package, installed if missing) in session and
# transaction mode in front of the local PostgreSQL, for the pooler tests
# (which also start it themselves); prints its env file.
.PHONY: pgbouncer-start pgbouncer-stop
pgbouncer-start:
	scripts/pgbouncer.sh start
pgbouncer-stop:
	scripts/pgbouncer.sh stop
