#!/usr/bin/env bash
# scripts/kafka.sh - a real Apache Kafka broker for onceflow's tests.
#
# Resolves Apache Kafka's server jars with Maven (org.apache.kafka:kafka_2.13,
# pinned below, plus its runtime dependencies) into a cache outside the
# repository, formats KRaft storage and runs ONE combined broker+controller
# (kafka.Kafka, the same main class kafka-server-start.sh runs) on free local
# ports with three client listeners:
#
#   PLAINTEXT  no TLS, no authentication
#   SSL        TLS; a client certificate is optional (ssl.client.auth=requested:
#              one that is sent must be signed by the script's CA)
#   SASL_SSL   TLS + SASL with SCRAM-SHA-512, SCRAM-SHA-256 and PLAIN
#
# The CA, the broker's certificate (SAN 127.0.0.1 and localhost), a client
# certificate and the SASL user (the same name and password for all three
# mechanisms) are made by this script on first start.
#
# Usage:
#   scripts/kafka.sh [--state DIR] start    resolve jars (cached), format, start, wait, print env
#   scripts/kafka.sh [--state DIR] stop     SIGTERM, wait for a clean shutdown (SIGKILL after 60 s)
#   scripts/kafka.sh [--state DIR] kill     SIGKILL the broker (fault tests), no waiting for Kafka
#   scripts/kafka.sh [--state DIR] restart  stop (or nothing if down), then start
#   scripts/kafka.sh [--state DIR] status   exit 0 if the broker answers, 1 if not
#   scripts/kafka.sh [--state DIR] env      print the env file
#   scripts/kafka.sh jars                   resolve the jars only; print the classpath directory
#   scripts/kafka.sh [--state DIR] clean    SIGKILL the broker and delete the state dir (data, certs, ports)
#
# A state dir holds one broker: its ports (chosen on first start and kept, so
# a restarted broker has the same addresses), data, certificates, logs, pid
# and env file. Default state dir: $ONCEFLOW_KAFKA_STATE or
# ${XDG_CACHE_HOME:-~/.cache}/onceflow/kafka-broker. Tests that kill and
# restart a broker pass their own --state DIR, so they never touch the shared
# one. Jar cache: $ONCEFLOW_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/onceflow)
# /kafka/<version>/libs; a second start reuses it (and ~/.m2).
#
# The env file (<state>/env, printed by `start` and `env`; `. <state>/env`
# or `eval "$(scripts/kafka.sh env)"`) exports:
#
#   ONCEFLOW_TEST_KAFKA_BROKERS          host:port of the PLAINTEXT listener
#   ONCEFLOW_TEST_KAFKA_SSL_BROKERS      host:port of the SSL listener
#   ONCEFLOW_TEST_KAFKA_SASL_BROKERS     host:port of the SASL_SSL listener
#   ONCEFLOW_TEST_KAFKA_CA_FILE          PEM CA that signed the broker's (and the client's) certificate
#   ONCEFLOW_TEST_KAFKA_CLIENT_CERT_FILE PEM client certificate (accepted by the SSL listener)
#   ONCEFLOW_TEST_KAFKA_CLIENT_KEY_FILE  PEM PKCS#8 unencrypted key of that certificate
#   ONCEFLOW_TEST_KAFKA_SERVER_NAME      TLS server name that the broker's certificate carries (localhost)
#   ONCEFLOW_TEST_KAFKA_SASL_USER        SASL user (SCRAM-SHA-512, SCRAM-SHA-256 and PLAIN)
#   ONCEFLOW_TEST_KAFKA_SASL_PASSWORD    its password
#   ONCEFLOW_TEST_KAFKA_SASL_MECHANISMS  SCRAM-SHA-512,SCRAM-SHA-256,PLAIN
#   ONCEFLOW_TEST_KAFKA_VERSION          Apache Kafka version of the broker
#   ONCEFLOW_TEST_KAFKA_SCRIPT           this script (absolute path)
#   ONCEFLOW_TEST_KAFKA_STATE            the state dir
#
# Needs java (17+), mvn and openssl. Heap: $ONCEFLOW_KAFKA_HEAP (default 512m).
set -euo pipefail

KAFKA_VERSION="${ONCEFLOW_KAFKA_VERSION:-4.3.1}"
SCALA_VERSION=2.13
LOG4J_VERSION=2.25.4
SLF4J_VERSION=2.0.17
HEAP="${ONCEFLOW_KAFKA_HEAP:-512m}"
SASL_USER=onceflow
SASL_PASSWORD=onceflow-test-secret
STORE_PASSWORD=onceflow-store
SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
CACHE="${ONCEFLOW_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/onceflow}"
STATE="${ONCEFLOW_KAFKA_STATE:-$CACHE/kafka-broker}"

say() { echo "kafka.sh: $*" >&2; }
die() {
	say "$*"
	exit 1
}

# need CMD [DEBIAN-PACKAGE]: as root with apt-get (CI, a fresh machine) a
# missing tool is installed from Debian's packages; otherwise it is an error
# that names the package.
need() {
	command -v "$1" >/dev/null 2>&1 && return
	if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
		say "$1 is not installed; installing Debian's ${2:-$1}"
		export DEBIAN_FRONTEND=noninteractive
		if ! { apt-get update -qq >&2 && apt-get install -y -qq "${2:-$1}" >/dev/null; }; then
			die "apt-get install ${2:-$1} failed"
		fi
		command -v "$1" >/dev/null 2>&1 && return
	fi
	die "$1 is not installed (needed: java 17+, mvn, openssl); on Debian: apt-get install ${2:-$1}"
}

# --- jars ------------------------------------------------------------------

libs_dir() { echo "$CACHE/kafka/$KAFKA_VERSION/libs"; }

resolve_jars() {
	local dir="$CACHE/kafka/$KAFKA_VERSION"
	if [ -f "$dir/libs/.complete" ]; then
		return
	fi
	need mvn maven
	mkdir -p "$dir"
	cat >"$dir/pom.xml" <<EOF
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>onceflow.test</groupId>
  <artifactId>kafka-broker</artifactId>
  <version>$KAFKA_VERSION</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_$SCALA_VERSION</artifactId><version>$KAFKA_VERSION</version></dependency>
    <!-- the broker logs through slf4j; route it to log4j2 as Kafka's own distribution does -->
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-api</artifactId><version>$SLF4J_VERSION</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j2-impl</artifactId><version>$LOG4J_VERSION</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId><version>$LOG4J_VERSION</version></dependency>
  </dependencies>
</project>
EOF
	say "resolving org.apache.kafka:kafka_$SCALA_VERSION:$KAFKA_VERSION and its runtime dependencies with Maven into $dir/libs"
	rm -rf "$dir/libs.tmp"
	if ! (cd "$dir" && mvn -B -q dependency:copy-dependencies -DincludeScope=runtime \
		-DoutputDirectory="$dir/libs.tmp" >"$dir/mvn.log" 2>&1); then
		tail -40 "$dir/mvn.log" >&2
		die "Maven could not resolve Kafka $KAFKA_VERSION (log: $dir/mvn.log)"
	fi
	[ -f "$dir/libs.tmp/kafka_$SCALA_VERSION-$KAFKA_VERSION.jar" ] || die "Maven ran but kafka_$SCALA_VERSION-$KAFKA_VERSION.jar is missing (log: $dir/mvn.log)"
	rm -rf "$dir/libs"
	mv "$dir/libs.tmp" "$dir/libs"
	touch "$dir/libs/.complete"
}

java_run() {
	# java_run MAINCLASS ARGS... with the broker's classpath and logging.
	local main="$1"
	shift
	java -Xmx"$HEAP" -Xms64m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -XX:+ExitOnOutOfMemoryError \
		-Djava.awt.headless=true -Dlog4j2.configurationFile="$STATE/log4j2.properties" \
		-Dkafka.logs.dir="$STATE/logs" -cp "$(libs_dir)/*" "$main" "$@"
}

# --- ports -----------------------------------------------------------------

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

port_listened() {
	# Also catches a port bound but not yet accepting.
	if command -v ss >/dev/null 2>&1; then
		ss -Htln "sport = :$1" 2>/dev/null | grep -q . && return 0
	fi
	port_busy "$1"
}

# The kernel's ephemeral ports (for outgoing connections and bind to port 0)
# start here: a port chosen below it cannot be handed to another socket
# between our choice and the broker's bind.
ephemeral_low() {
	local low _high
	read -r low _high </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || low=32768
	echo "$low"
}

free_port() {
	local p taken lo=20000 span
	span=$(($(ephemeral_low) - lo))
	[ "$span" -ge 1000 ] || { lo=$(($(ephemeral_low) - 11000)); span=10000; }
	for _ in $(seq 1 200); do
		p=$((lo + RANDOM % span))
		taken=0
		for q in "${CHOSEN[@]:-}"; do [ "$q" = "$p" ] && taken=1; done
		if [ "$taken" = 0 ] && ! port_listened "$p"; then
			CHOSEN+=("$p")
			echo "$p"
			return
		fi
	done
	die "no free local port found"
}

choose_ports() {
	if [ -f "$STATE/ports" ]; then
		# shellcheck disable=SC1091
		. "$STATE/ports"
		# Ports kept from before they were chosen below the ephemeral range
		# are chosen again while the broker is down, on fresh storage (the
		# old metadata names the old controller port).
		local low p
		low=$(ephemeral_low)
		for p in "$PLAIN_PORT" "$SSL_PORT" "$SASL_PORT" "$CONTROLLER_PORT"; do
			if [ "$p" -ge "$low" ] && ! pid_alive; then
				rm -rf "$STATE/ports" "$STATE/data"
				break
			fi
		done
		[ -f "$STATE/ports" ] && return
	fi
	CHOSEN=()
	PLAIN_PORT=$(free_port)
	CHOSEN+=("$PLAIN_PORT")
	SSL_PORT=$(free_port)
	CHOSEN+=("$SSL_PORT")
	SASL_PORT=$(free_port)
	CHOSEN+=("$SASL_PORT")
	CONTROLLER_PORT=$(free_port)
	printf 'PLAIN_PORT=%s\nSSL_PORT=%s\nSASL_PORT=%s\nCONTROLLER_PORT=%s\n' \
		"$PLAIN_PORT" "$SSL_PORT" "$SASL_PORT" "$CONTROLLER_PORT" >"$STATE/ports"
}

# --- certificates ------------------------------------------------------------

make_certs() {
	local c="$STATE/certs"
	if [ -f "$c/server.p12" ] && [ -f "$c/client.key" ]; then
		return
	fi
	need openssl
	rm -rf "$c"
	mkdir -p "$c"
	(
		cd "$c"
		openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=onceflow test CA" \
			-keyout ca.key -out ca.pem -addext basicConstraints=critical,CA:TRUE \
			-addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
		printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' >server.ext
		openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr 2>/dev/null
		openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
			-extfile server.ext -out server.pem 2>/dev/null
		openssl pkcs12 -export -in server.pem -inkey server.key -certfile ca.pem -name broker \
			-passout "pass:$STORE_PASSWORD" -out server.p12
		printf 'extendedKeyUsage=clientAuth\n' >client.ext
		openssl req -newkey rsa:2048 -nodes -subj "/CN=onceflow-client" -keyout client.key.tmp -out client.csr 2>/dev/null
		openssl pkcs8 -topk8 -nocrypt -in client.key.tmp -out client.key
		rm -f client.key.tmp
		openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
			-extfile client.ext -out client.pem 2>/dev/null
	)
}

# --- config ----------------------------------------------------------------

write_config() {
	mkdir -p "$STATE/logs" "$STATE/data"
	cat >"$STATE/log4j2.properties" <<EOF
status = error
appender.file.type = File
appender.file.name = file
appender.file.fileName = $STATE/logs/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.ak.name = org.apache.kafka
logger.ak.level = INFO
logger.log.name = org.apache.kafka.storage.internals.log
logger.log.level = WARN
logger.req.name = kafka.request.logger
logger.req.level = WARN
EOF
	cat >"$STATE/server.properties" <<EOF
# Written by scripts/kafka.sh; one combined broker+controller for tests.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$PLAIN_PORT,SSL://127.0.0.1:$SSL_PORT,SASL_SSL://127.0.0.1:$SASL_PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$PLAIN_PORT,SSL://127.0.0.1:$SSL_PORT,SASL_SSL://127.0.0.1:$SASL_PORT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,SSL:SSL,SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
log.dirs=$STATE/data

# One broker: every internal topic has one replica.
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=8
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
default.replication.factor=1
min.insync.replicas=1
num.partitions=1

# Tests use short group timeouts and must not wait for rebalances.
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=100
group.consumer.min.session.timeout.ms=1000
group.consumer.min.heartbeat.interval.ms=500

# TLS (SSL and SASL_SSL listeners).
ssl.keystore.type=PKCS12
ssl.keystore.location=$STATE/certs/server.p12
ssl.keystore.password=$STORE_PASSWORD
ssl.key.password=$STORE_PASSWORD
ssl.truststore.type=PEM
ssl.truststore.location=$STATE/certs/ca.pem
listener.name.ssl.ssl.client.auth=requested
listener.name.sasl_ssl.ssl.client.auth=none

# SASL on SASL_SSL: SCRAM users are stored in the metadata log (added at
# format time), PLAIN users in the JAAS config.
sasl.enabled.mechanisms=SCRAM-SHA-512,SCRAM-SHA-256,PLAIN
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_$SASL_USER="$SASL_PASSWORD";

# Small machine.
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
log.cleaner.threads=1
log.retention.check.interval.ms=300000
EOF
}

format_storage() {
	if [ -f "$STATE/data/meta.properties" ]; then
		return
	fi
	local id
	id="$(java_run kafka.tools.StorageTool random-uuid 2>/dev/null | tail -1)"
	[ -n "$id" ] || die "kafka.tools.StorageTool random-uuid printed nothing"
	if ! java_run kafka.tools.StorageTool format -c "$STATE/server.properties" -t "$id" \
		--add-scram "SCRAM-SHA-512=[name=$SASL_USER,password=$SASL_PASSWORD]" \
		--add-scram "SCRAM-SHA-256=[name=$SASL_USER,password=$SASL_PASSWORD]" \
		>"$STATE/logs/format.log" 2>&1; then
		cat "$STATE/logs/format.log" >&2
		die "formatting KRaft storage failed"
	fi
}

write_env() {
	cat >"$STATE/env" <<EOF
export ONCEFLOW_TEST_KAFKA_BROKERS=127.0.0.1:$PLAIN_PORT
export ONCEFLOW_TEST_KAFKA_SSL_BROKERS=127.0.0.1:$SSL_PORT
export ONCEFLOW_TEST_KAFKA_SASL_BROKERS=127.0.0.1:$SASL_PORT
export ONCEFLOW_TEST_KAFKA_CA_FILE=$STATE/certs/ca.pem
export ONCEFLOW_TEST_KAFKA_CLIENT_CERT_FILE=$STATE/certs/client.pem
export ONCEFLOW_TEST_KAFKA_CLIENT_KEY_FILE=$STATE/certs/client.key
export ONCEFLOW_TEST_KAFKA_SERVER_NAME=localhost
export ONCEFLOW_TEST_KAFKA_SASL_USER=$SASL_USER
export ONCEFLOW_TEST_KAFKA_SASL_PASSWORD=$SASL_PASSWORD
export ONCEFLOW_TEST_KAFKA_SASL_MECHANISMS=SCRAM-SHA-512,SCRAM-SHA-256,PLAIN
export ONCEFLOW_TEST_KAFKA_VERSION=$KAFKA_VERSION
export ONCEFLOW_TEST_KAFKA_SCRIPT=$SCRIPT
export ONCEFLOW_TEST_KAFKA_STATE=$STATE
EOF
}

# --- process ---------------------------------------------------------------

pid_alive() {
	[ -f "$STATE/pid" ] || return 1
	local pid
	pid="$(cat "$STATE/pid")"
	[ -n "$pid" ] && kill -0 "$pid" 2>/dev/null &&
		tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "kafka.Kafka $STATE/server.properties"
}

# child_running PID: the process exists and is not a zombie.
child_running() {
	[ -n "$1" ] && kill -0 "$1" 2>/dev/null &&
		[ "$(sed -E 's/^[0-9]+ \(.*\) (.).*/\1/' "/proc/$1/stat" 2>/dev/null)" != Z ]
}

# api_versions PORT: send an ApiVersions v0 request over plain TCP and check
# the broker answers with our correlation id and error code 0.
api_versions() {
	local out
	out="$(
		exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
		printf '\x00\x00\x00\x0f\x00\x12\x00\x00\x00\x00\x00\x2a\x00\x05probe' >&3
		timeout 5 head -c 10 <&3 | od -An -tx1 | tr -d ' \n'
	)" 2>/dev/null || return 1
	[ "${out:8:12}" = "0000002a0000" ]
}

# tls_answers PORT: a TLS handshake verified against the CA and the name localhost.
tls_answers() {
	openssl s_client -connect "127.0.0.1:$1" -servername localhost -verify_hostname localhost \
		-CAfile "$STATE/certs/ca.pem" -verify_return_error -brief </dev/null >/dev/null 2>&1
}

answers() {
	api_versions "$PLAIN_PORT" && tls_answers "$SSL_PORT" && tls_answers "$SASL_PORT"
}

started_in_log() { grep -q "Kafka Server started" "$STATE/logs/server.out" "$STATE/logs/server.log" 2>/dev/null; }

start() {
	need java openjdk-17-jre-headless
	mkdir -p "$STATE"
	STATE="$(cd "$STATE" && pwd)"
	# One start at a time per state dir (the broker does not inherit the lock).
	exec 9>"$STATE/.lock"
	command -v flock >/dev/null 2>&1 && flock -w 300 9
	choose_ports
	if pid_alive; then
		if answers; then
			say "already running (pid $(cat "$STATE/pid"))"
			write_env
			print_env
			return
		fi
	fi
	resolve_jars
	make_certs
	write_config
	format_storage
	write_env
	for p in "$PLAIN_PORT" "$SSL_PORT" "$SASL_PORT" "$CONTROLLER_PORT"; do
		if ! pid_alive && port_listened "$p"; then
			die "port $p (kept in $STATE/ports) is taken by another process; \`$SCRIPT --state $STATE clean\` chooses new ports"
		fi
	done
	pid_alive && kill -TERM "$(cat "$STATE/pid")" 2>/dev/null && wait_gone 60
	local mark="$STATE/logs/server.out"
	# A fresh log per start, so "Kafka Server started" is this start's.
	[ -f "$STATE/logs/server.log" ] && mv -f "$STATE/logs/server.log" "$STATE/logs/server.log.1"
	: >"$mark"
	# Not in our process group: a test that runs this script and is killed
	# must not take the broker with it before it calls stop.
	setsid java -Xmx"$HEAP" -Xms256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -XX:+ExitOnOutOfMemoryError \
		-Djava.awt.headless=true \
		-Dlog4j2.configurationFile="$STATE/log4j2.properties" -Dkafka.logs.dir="$STATE/logs" \
		-cp "$(libs_dir)/*" kafka.Kafka "$STATE/server.properties" \
		>"$mark" 2>&1 </dev/null 9>&- &
	echo $! >"$STATE/pid"
	say "started Apache Kafka $KAFKA_VERSION (pid $!, state $STATE); waiting until it answers"
	local deadline=$((SECONDS + ${ONCEFLOW_KAFKA_START_TIMEOUT:-300}))
	while :; do
		# Not pid_alive: until the child has exec'd java its command line is
		# still this shell's, which read as "exited" right after a restart.
		# A child that did die stays a zombie of this shell: not running.
		if ! child_running "$(cat "$STATE/pid")"; then
			tail -n 30 "$STATE/logs/server.log" "$mark" >&2 2>/dev/null || true
			die "the broker exited during start-up (logs: $STATE/logs)"
		fi
		if started_in_log && answers; then
			break
		fi
		if [ "$SECONDS" -ge "$deadline" ]; then
			tail -30 "$STATE/logs/server.log" >&2 2>/dev/null || true
			die "the broker did not answer within ${ONCEFLOW_KAFKA_START_TIMEOUT:-300} s (logs: $STATE/logs)"
		fi
		sleep 0.5
	done
	say "Apache Kafka $KAFKA_VERSION answers: PLAINTEXT 127.0.0.1:$PLAIN_PORT SSL 127.0.0.1:$SSL_PORT SASL_SSL 127.0.0.1:$SASL_PORT"
	print_env
}

wait_gone() {
	local pid limit="$1"
	pid="$(cat "$STATE/pid" 2>/dev/null || true)"
	for _ in $(seq 1 $((limit * 5))); do
		if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
			return 0
		fi
		sleep 0.2
	done
	return 1
}

stop() {
	if ! pid_alive; then
		say "not running"
		rm -f "$STATE/pid"
		return
	fi
	local pid
	pid="$(cat "$STATE/pid")"
	kill -TERM "$pid"
	if ! wait_gone 60; then
		say "no clean shutdown within 60 s; SIGKILL"
		kill -KILL "$pid" 2>/dev/null || true
		wait_gone 10 || true
	fi
	rm -f "$STATE/pid"
	say "stopped"
}

kill_broker() {
	if ! pid_alive; then
		die "not running"
	fi
	kill -KILL "$(cat "$STATE/pid")"
	wait_gone 30 || die "pid $(cat "$STATE/pid") survived SIGKILL"
	rm -f "$STATE/pid"
	say "killed"
}

print_env() { cat "$STATE/env"; }

status() {
	[ -f "$STATE/ports" ] || {
		say "no broker in $STATE"
		return 1
	}
	# shellcheck disable=SC1091
	. "$STATE/ports"
	if pid_alive && answers; then
		say "running (pid $(cat "$STATE/pid")), answers on 127.0.0.1:$PLAIN_PORT"
		return 0
	fi
	say "not answering"
	return 1
}

while [ $# -gt 0 ]; do
	case "$1" in
	--state)
		STATE="$2"
		shift 2
		;;
	--state=*)
		STATE="${1#--state=}"
		shift
		;;
	*) break ;;
	esac
done
mkdir -p "$STATE"
STATE="$(cd "$STATE" && pwd)"

case "${1:-}" in
start) start ;;
stop) stop ;;
kill) kill_broker ;;
restart)
	stop
	start
	;;
status) status ;;
env)
	[ -f "$STATE/env" ] || die "no env file in $STATE: run start first"
	print_env
	;;
jars)
	resolve_jars
	libs_dir
	;;
clean)
	# The data goes too: no need for a clean shutdown.
	if pid_alive; then
		kill -KILL "$(cat "$STATE/pid")"
		wait_gone 30 || true
	fi
	rm -rf "$STATE"
	;;
*)
	sed -n '2,/^set -euo/p' "$0" | sed 's/^# \{0,1\}//' | head -n -1 >&2
	exit 2
	;;
esac
