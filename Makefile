# The targets CI runs (.ci/run calls `make services`, `make test`: vet, gofmt,
# staticcheck, go test -race on kfake, and `make test-kafka`: the Kafka-facing
# suites against a real Apache Kafka broker started by scripts/kafka.sh).
GO ?= go

.PHONY: test check vet fmt-check staticcheck race bench demo services services-stop kafka-start kafka-stop test-kafka

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

bench:
	$(GO) test -run '^$$' -bench . -benchtime 1x ./relay/ ./consumer/ ./idempotency/ ./otelonceflow/

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
