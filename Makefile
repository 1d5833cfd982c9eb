# The targets CI runs (.ci/run calls `make test`: vet, gofmt, staticcheck, go test -race).
GO ?= go

.PHONY: test check vet fmt-check staticcheck race bench demo

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
	$(GO) test -run '^$$' -bench . -benchtime 1x ./relay/ ./consumer/ ./idempotency/

demo:
	$(GO) run ./cmd/onceflow demo

# PgBouncer (Debian's package, installed if missing) in session and
# transaction mode in front of the local PostgreSQL, for the pooler tests
# (which also start it themselves); prints its env file.
.PHONY: pgbouncer-start pgbouncer-stop
pgbouncer-start:
	scripts/pgbouncer.sh start
pgbouncer-stop:
	scripts/pgbouncer.sh stop
