// Command chaosworker is the worker the chaos test runs: the built-in task
// types plus chaos.sleep, which is demo.sleep recording every execution in
// the file named by CHAOS_EXEC_LOG, so the test can count duplicates.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/demo"
	"github.com/conveyorhq/conveyor/worker"
)

func main() {
	log, err := os.OpenFile(os.Getenv("CHAOS_EXEC_LOG"), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaosworker: CHAOS_EXEC_LOG:", err)
		os.Exit(2)
	}
	record := func(ctx context.Context, t conveyor.Task, r conveyor.Reporter) (any, error) {
		// One unbuffered append per execution: it survives a SIGKILL.
		if _, err := fmt.Fprintf(log, "%s %d\n", t.ID, t.Attempt); err != nil {
			return nil, err
		}
		return demo.Sleep(ctx, t, r)
	}
	worker.Main(append(demo.Handlers(), conveyor.Handle("chaos.sleep", record))...)
}
