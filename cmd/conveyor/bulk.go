package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/spf13/cobra"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

// bulkAction is cancel or retry, applied to every task a filter matches.
type bulkAction struct {
	// verb is the command's name; done says what happened to a task.
	verb, done string
	// statuses are those of the tasks the action can change; scope says
	// which tasks --all takes on, for the help.
	statuses []string
	scope    string
	call     func(*apiclient.Client, context.Context, apiclient.BulkRequest) (apiclient.BulkResult, error)
	// changed is how many tasks a call changed.
	changed func(apiclient.BulkResult) int
}

var (
	cancelAll = bulkAction{verb: "cancel", done: "cancelled",
		statuses: []string{apiclient.StatusPending, apiclient.StatusInProgress},
		scope: `With --all, cancel every PENDING task, and every IN_PROGRESS one not yet
asked to stop, that the filter flags match; all of them when none is given.`,
		call:    (*apiclient.Client).CancelTasks,
		changed: func(r apiclient.BulkResult) int { return r.Cancelled }}
	retryAll = bulkAction{verb: "retry", done: "retried",
		statuses: []string{apiclient.StatusFailed, apiclient.StatusCancelled},
		scope: `With --all, retry every FAILED or CANCELLED task that the filter flags
match; all of them when none is given.`,
		call:    (*apiclient.Client).RetryTasks,
		changed: func(r apiclient.BulkResult) int { return r.Retried }}
)

// title is s with its first letter upper case.
func title(s string) string { return strings.ToUpper(s[:1]) + s[1:] }

// bulkHelp is the part of the help of cancel and retry on --all.
func bulkHelp(act bulkAction) string {
	return "\n" + act.scope + strings.NewReplacer("Verb", title(act.verb), "DONE", act.done).Replace(`
The filters are --status, --type, --created-after and --created-before
(each an RFC 3339 time, or a duration such as 1h meaning that long ago),
and --q (a task id, or a metadata key=value). The command counts the tasks
first and asks on the terminal, say "Verb 12 tasks matching
type=demo.sleep? [y/N]"; --yes answers yes, and is needed when standard
input is not a terminal; --dry-run prints the count and changes nothing.
The API then changes at most the count confirmed, and nothing at all if
more tasks match by then (a 409: count again).

The API changes at most 1000 tasks per call; while more remain, the command
counts again and calls again. A confirmation covers at most the count it
confirmed: when the new count is more than what it has left (new tasks
matched meanwhile), the command asks again, about the new count; --yes goes
on without asking. It prints "DONE 12, skipped 0" (skipped: tasks that
changed meanwhile and were left alone); with -o json, each of the API's
answers, the counts included, as a JSON line. The exit status is 1 when a
question is not answered yes.`)
}

// bulkFlags are the flags of cancel and retry that act on every task a
// filter matches.
type bulkFlags struct {
	filterFlags
	all, yes, dryRun bool
}

func (b *bulkFlags) register(cmd *cobra.Command, act bulkAction) {
	b.filterFlags.register(cmd, act.statuses)
	f := cmd.Flags()
	f.BoolVar(&b.all, "all", false, act.verb+" every task the filter flags match, after a confirmation")
	f.BoolVarP(&b.yes, "yes", "y", false, "with --all: do not ask for a confirmation")
	f.BoolVar(&b.dryRun, "dry-run", false, "with --all: print how many tasks match, and change none")
}

// args checks the arguments: one task ID, or --all and no ID; the flags
// of --all go with it only.
func (b *bulkFlags) args(cmd *cobra.Command, args []string) error {
	if b.all {
		if len(args) > 0 {
			return usagef("%s --all takes no task ID (the filter flags choose the tasks), got %q", cmd.Name(), args)
		}
		return nil
	}
	for _, name := range append(slices.Clone(filterFlagNames), "yes", "dry-run") {
		if cmd.Flags().Changed(name) {
			return usagef("--%s goes with --all", name)
		}
	}
	if len(args) != 1 {
		return usagef("%s wants a task ID, or --all and filter flags; got %d arguments", cmd.Name(), len(args))
	}
	return nil
}

// runBulk applies act to every task the flags' filter matches, after the
// person confirmed the count, or with --dry-run prints the count.
func (a *app) runBulk(cmd *cobra.Command, act bulkAction, b bulkFlags) error {
	filter, err := b.filter(a.now())
	if err != nil {
		return err
	}
	if !b.yes && !b.dryRun && !a.stdinTerminal {
		return usagef("%s --all asks for a confirmation, and standard input is not a terminal: "+
			"give --yes to %s without asking (--dry-run counts)", act.verb, act.verb)
	}
	c, err := a.api(cmd)
	if err != nil {
		return err
	}
	if b.dryRun {
		count, err := a.bulkCall(cmd.Context(), c, act, apiclient.BulkRequest{Filter: filter, DryRun: true})
		if err != nil || a.output == outputJSON {
			return err
		}
		_, err = fmt.Fprintln(a.stdout, count.Matched)
		return err
	}
	return a.applyBulk(cmd.Context(), c, act, filter, b.yes)
}

// applyBulk counts the tasks filter matches, asks the person to confirm
// the count (unless yes), and applies act to at most that many; then again
// while the API says more remain. A confirmation covers the changes it
// counted: a later count beyond what it has left is asked again.
func (a *app) applyBulk(ctx context.Context, c *apiclient.Client, act bulkAction, filter apiclient.TaskFilter, yes bool) (err error) {
	var changed, skipped, calls, confirmed int
	defer func() {
		// What was done is worth saying even when a later call failed.
		if (err == nil || calls > 0) && a.output != outputJSON {
			fmt.Fprintf(a.stdout, "%s %d, skipped %d\n", act.done, changed, skipped)
		}
	}()
	answers := bufio.NewReader(a.stdin)
	for {
		count, err := a.bulkCall(ctx, c, act, apiclient.BulkRequest{Filter: filter, DryRun: true})
		if err != nil {
			return err
		}
		n := count.Matched
		if n == 0 {
			return nil
		}
		if !yes && n > confirmed {
			ok, err := a.confirm(ctx, answers, question(act, filter, n, calls > 0))
			if err != nil {
				return err
			}
			if !ok {
				fmt.Fprintf(a.stderr, "conveyor: not confirmed: %d %s left as they are\n", n, plural(n, "task"))
				return &exitStatus{code: exitFailure}
			}
			confirmed = n
		}
		res, err := a.bulkCall(ctx, c, act, apiclient.BulkRequest{Filter: filter, Expected: &n})
		if err != nil {
			return err
		}
		calls++
		done := act.changed(res)
		changed, skipped, confirmed = changed+done, skipped+res.Skipped, max(confirmed-done, 0)
		if !res.More {
			return nil
		}
		if done == 0 {
			// Every task this call took on changed meanwhile: stop rather
			// than go round for ever.
			return fmt.Errorf("%d %s still match, but the last call could %s none of them: run the command again",
				res.Matched, plural(res.Matched, "task"), act.verb)
		}
	}
}

// bulkCall calls the API's bulk action; with -o json, it writes the
// answer as a JSON line.
func (a *app) bulkCall(ctx context.Context, c *apiclient.Client, act bulkAction, in apiclient.BulkRequest) (apiclient.BulkResult, error) {
	res, err := act.call(c, ctx, in)
	if err == nil && a.output == outputJSON {
		err = writeJSONLine(a.stdout, res.JSON())
	}
	return res, err
}

// question asks to act on n tasks: "Cancel 12 tasks matching
// type=demo.sleep?"; again when some were already.
func question(act bulkAction, f apiclient.TaskFilter, n int, again bool) string {
	verb := title(act.verb)
	more := ""
	if again {
		more = "more "
	}
	if d := describe(f); d != "" {
		return fmt.Sprintf("%s %d %s%s matching %s?", verb, n, more, plural(n, "task"), d)
	}
	all := "all "
	if again {
		all = ""
	}
	return fmt.Sprintf("%s %s%d %s%s %s?", verb, all, n, more, strings.Join(act.statuses, " or "), plural(n, "task"))
}

// confirm asks question on stderr and reads the answer, a line of stdin:
// yes only for "y" or "yes". An interrupt ends the wait.
func (a *app) confirm(ctx context.Context, answers *bufio.Reader, question string) (bool, error) {
	fmt.Fprintf(a.stderr, "%s [y/N] ", question)
	type answer struct {
		line string
		err  error
	}
	got := make(chan answer, 1)
	go func() {
		line, err := answers.ReadString('\n')
		got <- answer{line, err}
	}()
	select {
	case <-ctx.Done():
		fmt.Fprintf(a.stderr, "\n")
		return false, ctx.Err()
	case ans := <-got:
		switch {
		case errors.Is(ans.err, io.EOF):
			fmt.Fprintf(a.stderr, "\n") // no newline was typed: end the question's line
		case ans.err != nil:
			return false, fmt.Errorf("read the answer: %w", ans.err)
		}
		s := strings.ToLower(strings.TrimSpace(ans.line))
		return s == "y" || s == "yes", nil
	}
}

// plural is noun for 1, else noun+"s".
func plural(n int, noun string) string {
	if n == 1 {
		return noun
	}
	return noun + "s"
}
