#!/usr/bin/env bash
# scripts/postgres.sh - make sure the PostgreSQL the tests use is up.
#
# With ONCEFLOW_TEST_DATABASE_URL set, only checks that it answers (the caller
# brought its own database). Otherwise: installs Debian's postgresql package
# if it is missing, lets postgres connect over TCP from 127.0.0.1 without a
# password, makes max_connections at least 200 (the tests run packages in
# parallel, each with its own pools), and starts the newest cluster. A server
# already running is left running: it is restarted only when its
# max_connections is below 200, and says so.
set -euo pipefail

PGURL="${ONCEFLOW_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable}"
MIN_CONNECTIONS=200
WANT_CONNECTIONS=400

say() { echo "postgres.sh: $*" >&2; }

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }

cluster_version() { find /etc/postgresql -mindepth 1 -maxdepth 1 -printf "%f\n" | sort -V | tail -1; }

configure() {
	local version="$1"
	local dir="/etc/postgresql/$version/main"
	# The tests connect as postgres over TCP without a password.
	if ! grep -qE '^host\s+all\s+all\s+127\.0\.0\.1/32\s+trust' "$dir/pg_hba.conf"; then
		sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$dir/pg_hba.conf"
	fi
	mkdir -p "$dir/conf.d"
	if ! grep -qs "max_connections" "$dir/conf.d/onceflow.conf"; then
		echo "max_connections = $WANT_CONNECTIONS # onceflow's tests (scripts/postgres.sh)" >>"$dir/conf.d/onceflow.conf"
	fi
}

wait_up() {
	for _ in $(seq 1 60); do
		pg_up && return 0
		sleep 1
	done
	say "PostgreSQL did not come up on 127.0.0.1:5432"
	exit 1
}

ensure_postgres() {
	if [ -n "${ONCEFLOW_TEST_DATABASE_URL:-}" ]; then
		return
	fi
	if ! pg_up; then
		if ! command -v pg_ctlcluster >/dev/null 2>&1; then
			say "PostgreSQL is not installed; installing it from Debian's packages"
			export DEBIAN_FRONTEND=noninteractive
			apt-get update -qq
			apt-get install -y -qq postgresql >/dev/null
		fi
		local version
		version="$(cluster_version)"
		configure "$version"
		say "starting PostgreSQL $version"
		pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
		wait_up
	fi
	local max
	max="$(psql "$PGURL" -qAtc 'SHOW max_connections')"
	if [ "$max" -lt "$MIN_CONNECTIONS" ]; then
		say "max_connections is $max, the tests need $MIN_CONNECTIONS: setting $WANT_CONNECTIONS and restarting PostgreSQL"
		psql "$PGURL" -qAtc "ALTER SYSTEM SET max_connections = $WANT_CONNECTIONS" >/dev/null
		pg_ctlcluster --skip-systemctl-redirect "$(cluster_version)" main restart
		wait_up
	fi
}

ensure_postgres
psql "$PGURL" -qAtc 'SELECT 1' >/dev/null
say "PostgreSQL up ($(psql "$PGURL" -qAtc 'SHOW server_version'), max_connections $(psql "$PGURL" -qAtc 'SHOW max_connections'))"
