# Conveyor — run `make help` for the targets.
SHELL := /bin/bash
GO ?= go
BIN := bin
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
# The services' version lives in internal/telemetry; the command line's in main.
LDFLAGS := -s -w -X github.com/conveyorhq/conveyor/internal/telemetry.Version=$(VERSION) -X main.version=$(VERSION)
CMDS := $(notdir $(wildcard cmd/*))
# The processes of the pipeline; bin/conveyor is the command-line client.
SERVICES := $(filter-out conveyor,$(CMDS))
TEST_TIMEOUT ?= 15m
# Every module of the repository: the root, the benchmark and the tools.
MODULES := . bench tools
# golangci-lint at the version pinned in tools/go.mod (a module of its own, so
# its dependencies stay out of the root go.mod); the first run builds it.
GOLANGCI_LINT := $(GO) tool -modfile=tools/go.mod golangci-lint

.PHONY: help build run test test-short lint fmt bench chaos screenshots tidy tidy-check clean

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

build: ## Build every binary into bin/ (the services and the conveyor command line)
	@mkdir -p $(BIN)
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/ ./cmd/...

run: build ## Run the whole pipeline (api, relay, worker) against local PostgreSQL and RabbitMQ
	@./scripts/run-all.sh $(addprefix $(BIN)/,$(SERVICES))

test: ## Run every test (real PostgreSQL and RabbitMQ, race detector on)
	$(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) ./...

test-short: ## Run the fast tests only (skips process-level fault tests)
	$(GO) test -race -count=1 -short ./...

lint: ## gofmt, go vet, and golangci-lint as pinned in tools/go.mod (.golangci.yaml), on the product and on bench/
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$unformatted" ]; then echo "gofmt needed:"; echo "$$unformatted"; exit 1; fi
	$(GO) vet ./...
	$(GOLANGCI_LINT) run ./...
	cd bench && $(GO) vet ./... && $(GO) tool -modfile=../tools/go.mod golangci-lint run ./...

fmt: ## Format the code
	gofmt -w $$(git ls-files '*.go')

bench: ## Benchmarks against the machine's ceilings and River, as ratios measured in the same run (BENCH_FLAGS=-quick for a short one)
	cd bench && $(GO) run . $(BENCH_FLAGS)

chaos: ## Chaos soak: api, 2 relays, 3 workers under faults for CHAOS_DURATION (default 10m), then every guarantee checked
	$(GO) test -count=1 -timeout 60m -run TestChaos ./chaos -v -chaos.duration=$(or $(CHAOS_DURATION),10m) -chaos.report=$(or $(CHAOS_REPORT),chaos-report.json)

screenshots: ## Retake the dashboard's screenshots in docs/screenshots (its browser test, in chromium)
	CONVEYOR_SCREENSHOTS=$(CURDIR)/docs/screenshots $(GO) test -count=1 -run TestDashboardInABrowser ./cmd/worker

tidy: ## go mod tidy in every module (root, bench/, tools/)
	@set -e; for m in $(MODULES); do echo "go mod tidy ($$m)"; $(GO) -C $$m mod tidy; done

tidy-check: ## Fail when go mod tidy would change a go.mod or go.sum (root, bench/, tools/)
	@status=0; for m in $(MODULES); do \
	  if $(GO) -C $$m mod tidy -diff; then echo "$$m: tidy"; else echo "$$m: not tidy (run make tidy)" >&2; status=1; fi; \
	done; exit $$status

clean: ## Remove build output
	rm -rf $(BIN)
