#!/usr/bin/env bash
# scripts/pgbouncer.sh - Debian's PgBouncer in front of the local PostgreSQL,
# a test fixture for onceflow's pooler tests.
#
# Runs ONE pgbouncer on a free loopback port with two pooled databases on the
# server at $ONCEFLOW_PGBOUNCER_UPSTREAM (default 127.0.0.1:5432, database
# postgres, user postgres, trust):
#
#   session      pool_mode=session
#   transaction  pool_mode=transaction
#
# Clients authenticate to PgBouncer with SCRAM-SHA-256 (user postgres, the
# password below) and may use TLS (a self-signed certificate for 127.0.0.1
# and localhost, made here; sslmode=verify-full with sslrootcert=its file).
# PgBouncer refuses to run as root, so it runs as $ONCEFLOW_PGBOUNCER_USER
# (default nobody).
#
# Usage:
#   scripts/pgbouncer.sh [--state DIR] start   install (apt-get) if missing, start, wait, print env
#   scripts/pgbouncer.sh [--state DIR] stop    stop it
#   scripts/pgbouncer.sh [--state DIR] env     print the env file
#
# The env file (<state>/env; eval "$(scripts/pgbouncer.sh env)") exports:
#
#   ONCEFLOW_TEST_PGBOUNCER_SESSION_URL      URL of the session-mode database (password in the URL)
#   ONCEFLOW_TEST_PGBOUNCER_TRANSACTION_URL  URL of the transaction-mode database (password in the URL)
#   ONCEFLOW_TEST_PGBOUNCER_PASSWORD         the password alone (for PGPASSWORD/.pgpass/file tests)
#   ONCEFLOW_TEST_PGBOUNCER_CA_FILE          the certificate to verify PgBouncer's TLS with
#   ONCEFLOW_TEST_PGBOUNCER_ADDR             127.0.0.1:port
#
# Default state dir: $ONCEFLOW_PGBOUNCER_STATE or
# ${TMPDIR:-/tmp}/onceflow-pgbouncer-<uid> (readable by the user it runs as).
set -euo pipefail

PASSWORD=onceflow-pgbouncer-secret
RUN_AS="${ONCEFLOW_PGBOUNCER_USER:-nobody}"
UPSTREAM="${ONCEFLOW_PGBOUNCER_UPSTREAM:-127.0.0.1:5432}"
# Not under $HOME: PgBouncer runs as another user and must reach its files.
STATE="${ONCEFLOW_PGBOUNCER_STATE:-${TMPDIR:-/tmp}/onceflow-pgbouncer-$(id -u)}"

say() { echo "pgbouncer.sh: $*" >&2; }
die() {
	say "$*"
	exit 1
}

if [ "${1:-}" = "--state" ]; then
	STATE="$2"
	shift 2
fi
cmd="${1:-}"

running() { [ -f "$STATE/pgbouncer.pid" ] && kill -0 "$(cat "$STATE/pgbouncer.pid")" 2>/dev/null; }

free_port() {
	python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

write_env() {
	local port url
	port="$(cat "$STATE/port")"
	url="postgres://postgres:$PASSWORD@127.0.0.1:$port"
	cat >"$STATE/env" <<ENV
export ONCEFLOW_TEST_PGBOUNCER_SESSION_URL='$url/session?sslmode=disable'
export ONCEFLOW_TEST_PGBOUNCER_TRANSACTION_URL='$url/transaction?sslmode=disable'
export ONCEFLOW_TEST_PGBOUNCER_PASSWORD='$PASSWORD'
export ONCEFLOW_TEST_PGBOUNCER_CA_FILE='$STATE/server.crt'
export ONCEFLOW_TEST_PGBOUNCER_ADDR='127.0.0.1:$port'
ENV
}

start() {
	command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || {
		say "installing pgbouncer (apt-get)"
		DEBIAN_FRONTEND=noninteractive apt-get install -y pgbouncer >/dev/null 2>&1 ||
			{ apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y pgbouncer >/dev/null; } ||
			die "cannot install pgbouncer: apt-get install pgbouncer"
	}
	local bin
	bin="$(command -v pgbouncer || echo /usr/sbin/pgbouncer)"
	mkdir -p "$STATE"
	# Test binaries of several packages may start it at once: one at a time.
	exec 9>"$STATE/start.lock"
	flock 9
	if running; then
		write_env
		cat "$STATE/env"
		return
	fi
	[ -f "$STATE/port" ] || free_port >"$STATE/port"
	if [ ! -f "$STATE/server.crt" ]; then
		openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
			-keyout "$STATE/server.key" -out "$STATE/server.crt" -days 3650 -subj /CN=localhost \
			-addext "subjectAltName=IP:127.0.0.1,DNS:localhost" >/dev/null 2>&1 || die "openssl could not make a certificate"
	fi
	local host="${UPSTREAM%:*}" uport="${UPSTREAM##*:}"
	printf '"postgres" "%s"\n' "$PASSWORD" >"$STATE/userlist.txt"
	cat >"$STATE/pgbouncer.ini" <<INI
[databases]
session = host=$host port=$uport dbname=postgres user=postgres pool_mode=session
transaction = host=$host port=$uport dbname=postgres user=postgres pool_mode=transaction

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $(cat "$STATE/port")
unix_socket_dir =
auth_type = scram-sha-256
auth_file = $STATE/userlist.txt
pool_mode = session
max_client_conn = 1000
default_pool_size = 40
server_reset_query = DISCARD ALL
ignore_startup_parameters = extra_float_digits
client_tls_sslmode = allow
client_tls_key_file = $STATE/server.key
client_tls_cert_file = $STATE/server.crt
logfile = $STATE/pgbouncer.log
pidfile = $STATE/pgbouncer.pid
INI
	chmod 755 "$STATE"
	chmod 644 "$STATE"/*
	chown "$RUN_AS" "$STATE" "$STATE"/* 2>/dev/null || true
	local args=(-d "$STATE/pgbouncer.ini")
	[ "$(id -u)" = 0 ] && args=(-d -u "$RUN_AS" "$STATE/pgbouncer.ini")
	"$bin" "${args[@]}" 9>&- || die "pgbouncer did not start (log: $STATE/pgbouncer.log)"
	for _ in $(seq 1 100); do
		if python3 -c "import socket,sys; socket.create_connection(('127.0.0.1', $(cat "$STATE/port")), 1)" 2>/dev/null; then
			write_env
			say "PgBouncer $("$bin" --version | head -1 | awk '{print $2}') on 127.0.0.1:$(cat "$STATE/port") (session, transaction) in front of $UPSTREAM"
			cat "$STATE/env"
			return
		fi
		sleep 0.1
	done
	die "pgbouncer does not answer (log: $STATE/pgbouncer.log)"
}

stop() {
	if running; then
		kill "$(cat "$STATE/pgbouncer.pid")"
		for _ in $(seq 1 50); do running || return 0; sleep 0.1; done
		die "pgbouncer did not stop"
	fi
}

case "$cmd" in
start) start ;;
stop) stop ;;
env) [ -f "$STATE/env" ] || die "not started: scripts/pgbouncer.sh start"; cat "$STATE/env" ;;
*) die "usage: scripts/pgbouncer.sh [--state DIR] start|stop|env" ;;
esac
