#!/usr/bin/env bash
# scripts/producer-pgbench.sh - issue 10's producer row in the issue's own
# shape: pgbench (a C client, so no Go writer shares the cores), each
# transaction one INSERT into a business table plus one event row through the
# contract's plain SQL, against the same transaction with the row going to a
# plain table of the outbox's columns (identity key, uuid default, no
# trigger, one index).
#
# The two contenders alternate within every round (the order flips each
# round) and the script prints each round's ratio and the medians, per
# writer count. It runs in a database of its own: a CREATE TABLE elsewhere in
# the database invalidates every connection's cached domain checks, which the
# outbox's CHECKs go through (migration 6), and the shared test database has
# many.
#
#   scripts/producer-pgbench.sh                 # 1 8 16 32 writers, 7 rounds of 5 s
#   WRITERS="1 16" ROUNDS=3 SECONDS_EACH=10 PROTOCOL=simple scripts/producer-pgbench.sh
#
# Stop the Kafka broker first (scripts/kafka.sh stop): the machine has two
# cores and the figures are CPU-bound from 8 writers.
set -euo pipefail

WRITERS="${WRITERS:-1 8 16 32}"
ROUNDS="${ROUNDS:-7}"
SECONDS_EACH="${SECONDS_EACH:-5}"
PROTOCOL="${PROTOCOL:-prepared}" # pgbench -M: simple, extended or prepared
BASE_URL="${PGBENCH_BASE_URL:-postgres://postgres@127.0.0.1:5432}"
DATABASE="${PGBENCH_DATABASE:-onceflow_pgbench}"
URL="$BASE_URL/$DATABASE?sslmode=disable"

cd "$(dirname "$0")/.."
work="$(mktemp -d)"
# The database is dropped at the end too: it holds the last round's rows.
cleanup() {
	rm -rf "$work"
	psql -qX "$BASE_URL/postgres?sslmode=disable" -c "DROP DATABASE IF EXISTS $DATABASE" >/dev/null 2>&1 || true
}
trap cleanup EXIT

psql -qX -v ON_ERROR_STOP=1 "$BASE_URL/postgres?sslmode=disable" \
	-c "SET client_min_messages = warning" -c "DROP DATABASE IF EXISTS $DATABASE" -c "CREATE DATABASE $DATABASE" >/dev/null
go build -o "$work/onceflow" ./cmd/onceflow
"$work/onceflow" migrate up --database-url "$URL" >/dev/null
psql -qX -v ON_ERROR_STOP=1 "$URL" >/dev/null <<'SQL'
CREATE TABLE business (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer text NOT NULL, amount_cents bigint NOT NULL);
CREATE TABLE plain (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id uuid NOT NULL DEFAULT gen_random_uuid(), topic text NOT NULL,
    key bytea, value bytea, headers jsonb, created_at timestamptz NOT NULL DEFAULT now());
SQL

for table in plain onceflow.outbox; do
	cat >"$work/${table#onceflow.}.sql" <<SQL
\set customer random(1, 1000000)
BEGIN;
INSERT INTO business (customer, amount_cents) VALUES ('customer-' || :customer, 500);
INSERT INTO $table (topic, key, value) VALUES ('orders', convert_to('customer-' || :customer, 'UTF8'), convert_to(repeat('x', 256), 'UTF8'));
END;
SQL
done

# tps runs one contender once and prints its transactions per second.
tps() {
	local writers="$1" contender="$2" threads=2
	((writers < threads)) && threads="$writers"
	pgbench -n -M "$PROTOCOL" -c "$writers" -j "$threads" -T "$SECONDS_EACH" \
		-f "$work/$contender.sql" "$URL" 2>/dev/null |
		awk '/^tps = / { printf "%.0f\n", $3 }'
}

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo "producer overhead, pgbench -M $PROTOCOL, $ROUNDS alternating rounds of ${SECONDS_EACH} s per contender; $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-8s %-44s %10s %10s %8s\n' writers "rounds (outbox / plain)" plain outbox median
for writers in $WRITERS; do
	psql -qX "$URL" -c "TRUNCATE business, plain, onceflow.outbox" -c CHECKPOINT >/dev/null
	ratios=() plains=() outboxes=()
	for ((round = 0; round < ROUNDS; round++)); do
		if ((round % 2)); then
			outbox=$(tps "$writers" outbox)
			plain=$(tps "$writers" plain)
		else
			plain=$(tps "$writers" plain)
			outbox=$(tps "$writers" outbox)
		fi
		plains+=("$plain") outboxes+=("$outbox")
		ratios+=("$(awk -v o="$outbox" -v p="$plain" 'BEGIN { printf "%.2f", o / p }')")
	done
	printf '%-8s %-44s %10s %10s %7sx\n' "$writers" "${ratios[*]}" \
		"$(printf '%s\n' "${plains[@]}" | median)" "$(printf '%s\n' "${outboxes[@]}" | median)" \
		"$(printf '%s\n' "${ratios[@]}" | median)"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
