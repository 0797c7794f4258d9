// Package worker builds a Conveyor worker binary around your handlers:
//
//	func main() {
//		worker.Main(
//			conveyor.Handle("images.resize", resize),
//			conveyor.Handle("reports.build", build),
//		)
//	}
//
// The worker is configured from the environment like cmd/worker
// (DATABASE_URL, AMQP_URL, WORKER_CONCURRENCY, LEASE_DURATION, ...; see the
// README) and stops gracefully on SIGTERM.
package worker

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/cli"
	"github.com/conveyorhq/conveyor/internal/config"
)

// Main runs a worker with the given handlers until SIGINT or SIGTERM, then
// exits: 0 after a clean stop, 1 on a failure, 2 on a bad configuration.
// The binary takes no arguments but `healthcheck URL` and -h (usage): any
// other is refused with exit 2. A program with arguments of its own calls
// Run.
func Main(handlers ...conveyor.Handler) {
	cli.Service("conveyor-worker", usage(handlers), func(ctx context.Context, cfg config.Worker, stdout io.Writer) error {
		return run(ctx, cfg, stdout, handlers)
	})
}

// usage is what -h prints: what the binary does and the types it runs.
func usage(handlers []conveyor.Handler) string {
	types := make([]string, len(handlers))
	for i, h := range handlers {
		types[i] = h.Type
	}
	return fmt.Sprintf(`usage: %[1]s [healthcheck URL]

With no argument, %[1]s runs its task handlers until SIGINT or SIGTERM,
and serves /healthz, /readyz and /metrics on WORKER_ADMIN_ADDR (default
:8082). Its task types: %[2]s.

  healthcheck URL  exit 0 if URL answers 200 (a container's healthcheck)

Everything else is configured by environment variables (DATABASE_URL,
AMQP_URL, WORKER_CONCURRENCY, …): see "Configuration" in Conveyor's
README.md.
`, filepath.Base(os.Args[0]), strings.Join(types, ", "))
}

// Run runs a worker with the given handlers until ctx is done, configured
// from the environment, logging to standard output. It is Main for programs
// that manage their own lifecycle.
func Run(ctx context.Context, handlers ...conveyor.Handler) error {
	cfg, err := config.Load[config.Worker]()
	if err != nil {
		return fmt.Errorf("conveyor-worker: %w", err)
	}
	return run(ctx, cfg, os.Stdout, handlers)
}
