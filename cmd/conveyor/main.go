// Command conveyor is Conveyor's command line: it submits, inspects,
// watches, cancels and retries tasks, shows the org's overview, applies
// jobs files, triggers and pauses jobs and types, starts and draws
// workflow runs, and manages the org's keys, users and roles, through the
// HTTP API. `conveyor --help` lists the commands.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	// The time zones of jobs files are checked where the command runs,
	// which may have no zone database of its own (Windows, a minimal
	// container).
	_ "time/tzdata"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], systemEnv())
	stop()
	os.Exit(exitCode(os.Stderr, err))
}
