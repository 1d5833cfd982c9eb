#!/usr/bin/env bash
# scripts/test-kafka.sh [PACKAGES...] - `make test-kafka`: the Kafka-facing
# suites against a real Apache Kafka broker.
#
# Uses the cluster in ONCEFLOW_TEST_KAFKA_BROKERS if set (a cluster of your
# own); otherwise starts scripts/kafka.sh's broker (or reuses it) and takes
# its env file. A broker that cannot start fails the run with the reason.
# Runs go test -race -v into a log and prints every package result, every
# skipped test with its reason and every failure (the whole log on failure),
# so nothing skips unseen. GO, KAFKA_RUN (a -run pattern) and
# KAFKA_TEST_TIMEOUT change the go command, the tests run and the timeout.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${ONCEFLOW_TEST_KAFKA_BROKERS:-}" ]; then
	if ! env="$(scripts/kafka.sh start)"; then
		echo "test-kafka: the Kafka broker did not start (reason above)" >&2
		exit 1
	fi
	eval "$env"
fi
if [ -z "${ONCEFLOW_TEST_KAFKA_BROKERS:-}" ]; then
	echo "test-kafka: no ONCEFLOW_TEST_KAFKA_BROKERS after starting the broker" >&2
	exit 1
fi
echo "test-kafka: Apache Kafka ${ONCEFLOW_TEST_KAFKA_VERSION:-(a cluster of your own)} at $ONCEFLOW_TEST_KAFKA_BROKERS"

log="$(mktemp -t onceflow-test-kafka.XXXXXX)"
status=0
"${GO:-go}" test -race -v -count=1 -timeout "${KAFKA_TEST_TIMEOUT:-25m}" -run "${KAFKA_RUN:-.}" "$@" >"$log" 2>&1 || status=$?
if [ "$status" -ne 0 ]; then
	echo "test-kafka: go test failed (exit $status); its whole output:"
	cat "$log"
fi
echo "test-kafka: skipped tests and why:"
# A skip's reason is the last line the test logged before its --- SKIP.
awk '
	/^=== (RUN|CONT|NAME|PAUSE) / { cur = $3; next }
	/^ *--- SKIP: / { sub(/^ +/, ""); print "  " $0 ": " msg[$3]; next }
	/^ +[^ ]+\.go:[0-9]+: / { if (cur != "") { line = $0; sub(/^ +/, "", line); msg[cur] = line } }
' "$log"
echo "test-kafka: results:"
grep -E '^(ok|FAIL|---)\s|^\s+--- FAIL' "$log" || true
rm -f "$log"
exit "$status"
