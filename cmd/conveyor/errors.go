package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

// Exit codes: 0 success, 1 a failure (the API's refusal, a task that did
// not complete, an unreachable API), 2 a command used wrongly, 130 an
// interrupt.
const (
	exitFailure   = 1
	exitUsage     = 2
	exitInterrupt = 130
)

// usageError is a command used wrongly: exit 2 with a pointer to the
// command's --help.
type usageError struct {
	msg string
	// cmd is the command's path, such as "conveyor submit".
	cmd string
}

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return &usageError{msg: fmt.Sprintf(format, args...)} }

// runError is an error a command returned while it ran, as opposed to one
// cobra found in its arguments before it ran (which is a usage error).
type runError struct{ err error }

func (e *runError) Error() string { return e.err.Error() }
func (e *runError) Unwrap() error { return e.err }

// exitStatus ends the command with code and no message: what went wrong
// is already on the screen (a task that failed, for instance).
type exitStatus struct{ code int }

func (e *exitStatus) Error() string { return fmt.Sprintf("exit status %d", e.code) }

// classify tells how err, from cmd, ends the process: an error cobra
// found before the command ran is a usage error of that command.
func classify(cmd *cobra.Command, err error) error {
	if err == nil {
		return nil
	}
	path := "conveyor"
	if cmd != nil {
		path = cmd.CommandPath()
	}
	if u, ok := errors.AsType[*usageError](err); ok {
		if u.cmd == "" {
			u.cmd = path
		}
		return u
	}
	_, ran := errors.AsType[*runError](err)
	_, status := errors.AsType[*exitStatus](err)
	if ran || status {
		return err
	}
	return &usageError{msg: err.Error(), cmd: path}
}

// markRunErrors wraps the RunE of cmd and of every command below it, so
// that exitCode can tell their errors from cobra's own usage errors.
func markRunErrors(cmd *cobra.Command) {
	if run := cmd.RunE; run != nil {
		cmd.RunE = func(cmd *cobra.Command, args []string) error {
			err := run(cmd, args)
			if err == nil {
				return nil
			}
			if _, usage := errors.AsType[*usageError](err); usage {
				return err
			}
			return &runError{err: err}
		}
	}
	for _, sub := range cmd.Commands() {
		markRunErrors(sub)
	}
}

// keyHint says where an API key is given, after a 401.
const keyHint = "give an API key with --token, CONVEYOR_TOKEN (or CONVEYOR_KEY), or token: in the config file"

// urlHint says where the API's URL is given, after a failed dial.
const urlHint = "is the API running at that address? --url, CONVEYOR_URL or url: in the config file names another"

// exitCode reports err on stderr, as "conveyor: <what> (HTTP status)" for
// the API's refusals, and returns the process's exit code.
func exitCode(stderr io.Writer, err error) int {
	if err == nil {
		return 0
	}
	if s, ok := errors.AsType[*exitStatus](err); ok {
		return s.code
	}
	if errors.Is(err, context.Canceled) {
		return exitInterrupt
	}
	if u, ok := errors.AsType[*usageError](err); ok {
		fmt.Fprintf(stderr, "conveyor: %s\nRun '%s --help' for usage.\n", u.msg, cmp.Or(u.cmd, "conveyor"))
		return exitUsage
	}
	fmt.Fprintf(stderr, "conveyor: %v\n", err)
	if apiclient.StatusOf(err) == 401 {
		fmt.Fprintf(stderr, "conveyor: %s\n", keyHint)
	}
	if apiclient.Unreachable(err) {
		fmt.Fprintf(stderr, "conveyor: %s\n", urlHint)
	}
	if e, ok := errors.AsType[*apiclient.Error](err); ok && e.RetryAfter > 0 {
		// A 429's or a 503's detail may point at the Retry-After header,
		// which is not on the screen.
		fmt.Fprintf(stderr, "conveyor: the API asks to retry after %s\n", e.RetryAfter)
	}
	return exitFailure
}
