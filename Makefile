# The targets CI runs (.ci/run calls `make test`).
GO ?= go

.PHONY: test check vet fmt-check race bench demo

test: check race

check: vet fmt-check

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
