// Package cli is the few lines every binary's main shares: read the
// configuration, run until SIGINT or SIGTERM, exit non-zero on error.
package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/conveyorhq/conveyor/internal/config"
)

// Main loads C from the environment and calls run with a context cancelled
// on SIGINT or SIGTERM. It never returns.
func Main[C interface{ Validate() error }](name string, run func(context.Context, C, io.Writer) error) {
	cfg, err := config.Load[C]()
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err = run(ctx, cfg, os.Stdout)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		os.Exit(1)
	}
	os.Exit(0)
}
