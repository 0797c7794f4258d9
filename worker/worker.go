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

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/cli"
	"github.com/conveyorhq/conveyor/internal/config"
)

// Main runs a worker with the given handlers until SIGINT or SIGTERM, then
// exits: 0 after a clean stop, 1 on a failure, 2 on a bad configuration.
func Main(handlers ...conveyor.Handler) {
	cli.Main("conveyor-worker", func(ctx context.Context, cfg config.Worker, stdout io.Writer) error {
		return run(ctx, cfg, stdout, handlers)
	})
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
