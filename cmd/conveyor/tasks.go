package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

// statuses are the task statuses, for completion and checks.
var statuses = []string{apiclient.StatusPending, apiclient.StatusInProgress, apiclient.StatusCompleted,
	apiclient.StatusFailed, apiclient.StatusCancelled}

func (a *app) submitCommand() *cobra.Command {
	var (
		payload, payloadFile, metadata, key string
		priority, maxAttempts               int
		visibility                          []string
		noDedupe, wait                      bool
		runAt, delay, concurrencyKey        string
		taskTimeout, heartbeatTimeout       time.Duration
	)
	cmd := &cobra.Command{
		Use:   "submit TYPE",
		Short: "Submit a task and print its id",
		Long: `Submit a task of TYPE. Its payload, a JSON object, comes from --payload,
from --payload-file (- for standard input), or from standard input when it
is not a terminal; without any, the payload is {}.

The task is due at once, or at --run-at (RFC 3339), or --delay (such as
90s or 2h30m) after the API stores it.

--task-timeout bounds each attempt of the task, and --heartbeat-timeout
the time between the heartbeats of its handler, in whole seconds (such as
90s or 10m); the worker gives up an attempt that outlasts either.
--concurrency-key puts the task in a group that the type's per-key limit
(conveyor types) counts apart.

The same type and payload as an existing task is that task (its id is
printed, with a note on standard error), unless --no-dedupe. With --wait,
the task is then followed to its end, as watch does, and the exit status
is 0 only if it COMPLETED.`,
		Example: `  conveyor submit demo.sleep --payload '{"steps":5,"step_ms":200}'
  echo '{"steps":3}' | conveyor submit demo.sleep --priority 9 --wait
  conveyor submit demo.sleep --payload-file job.json --idempotency-key order-42 -o json
  conveyor submit demo.sleep --delay 10m`,
		Args: exactArgs(1, "TYPE"),
		RunE: func(cmd *cobra.Command, args []string) error {
			req := apiclient.SubmitRequest{Type: args[0], Visibility: visibility}
			var err error
			if req.Payload, err = a.readPayload(cmd, payload, payloadFile); err != nil {
				return err
			}
			if metadata != "" {
				if req.Metadata, err = jsonObject("--metadata", []byte(metadata)); err != nil {
					return err
				}
			}
			if cmd.Flags().Changed("priority") {
				req.Priority = &priority
			}
			if cmd.Flags().Changed("max-attempts") {
				req.MaxAttempts = &maxAttempts
			}
			if noDedupe {
				req.Dedupe = new(false)
			}
			if runAt != "" {
				at, err := time.Parse(time.RFC3339, runAt)
				if err != nil {
					return usagef("--run-at: want an RFC 3339 time such as 2026-11-23T18:00:00Z, got %q", runAt)
				}
				if _, err := at.MarshalText(); err != nil {
					// time.Parse takes a few times that JSON, and so the
					// API, does not: an offset of 24 hours or more.
					return usagef("--run-at: %q is not a time the API takes: its offset from UTC must be under 24 hours", runAt)
				}
				req.RunAt = &at
			}
			req.Delay = delay
			req.ConcurrencyKey = concurrencyKey
			if req.TimeoutSeconds, err = wholeSeconds("--task-timeout", taskTimeout); err != nil {
				return err
			}
			if req.HeartbeatTimeoutSeconds, err = wholeSeconds("--heartbeat-timeout", heartbeatTimeout); err != nil {
				return err
			}
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			t, created, err := c.Submit(cmd.Context(), req, key)
			if err != nil {
				return err
			}
			switch {
			case created:
			case key != "" && noDedupe:
				// Only the key can have matched: --no-dedupe is no way out.
				fmt.Fprintf(a.stderr, "conveyor: the idempotency key %s is task %s's (%s), which is not submitted again\n", key, t.ID, t.Status)
			case key != "":
				fmt.Fprintf(a.stderr, "conveyor: the same idempotency key or input as task %s (%s), which is not submitted again\n", t.ID, t.Status)
			default:
				fmt.Fprintf(a.stderr, "conveyor: the same input as task %s (%s), which is not submitted again (unless --no-dedupe)\n", t.ID, t.Status)
			}
			return a.writeNewTask(cmd.Context(), c, t, wait)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&payload, "payload", "p", "", "the payload, a JSON object")
	f.StringVarP(&payloadFile, "payload-file", "f", "", "read the payload from this file (- for standard input)")
	f.IntVar(&priority, "priority", 0, "priority, 0 to 9 (9 most urgent; unset: the API's default, 5)")
	f.IntVar(&maxAttempts, "max-attempts", 0, "attempts before the task fails, 1 to 100 (unset: the API's TASK_DEFAULT_MAX_ATTEMPTS, 3 unless set)")
	f.StringVar(&metadata, "metadata", "", "metadata, a JSON object")
	f.StringSliceVar(&visibility, "visibility", nil, "restrict the task to members of these org roles (repeat or comma-separate)")
	f.BoolVar(&noDedupe, "no-dedupe", false, "submit even if a task of the same type and payload exists")
	f.StringVarP(&key, "idempotency-key", "k", "", "the Idempotency-Key: the same key always gets the same task")
	f.BoolVarP(&wait, "wait", "w", false, "follow the task to its end; exit 0 only if it COMPLETED")
	f.StringVar(&runAt, "run-at", "", "when the task becomes due, RFC 3339")
	f.StringVar(&delay, "delay", "", "how long after it is stored the task becomes due, such as 90s or 2h30m")
	f.StringVar(&concurrencyKey, "concurrency-key", "", "the group the type's per-key limit counts the task in, such as an account id")
	f.DurationVar(&taskTimeout, "task-timeout", 0, "the longest an attempt may run, in whole seconds, such as 90s or 10m")
	f.DurationVar(&heartbeatTimeout, "heartbeat-timeout", 0, "the longest the handler may go without a heartbeat, in whole seconds")
	cmd.MarkFlagsMutuallyExclusive("payload", "payload-file")
	cmd.MarkFlagsMutuallyExclusive("run-at", "delay")
	return cmd
}

// writeNewTask shows a task just made: its id, or its document; with
// wait, it then follows the task to its end, as watch does.
func (a *app) writeNewTask(ctx context.Context, c *apiclient.Client, t apiclient.Task, wait bool) error {
	var err error
	switch {
	case a.output == outputJSON && wait:
		// JSON Lines: the task, then its events.
		err = writeJSONLine(a.stdout, t.JSON())
	case a.output == outputJSON:
		err = writeJSON(a.stdout, t.JSON())
	default:
		_, err = fmt.Fprintln(a.stdout, t.ID)
	}
	if err != nil || !wait {
		return err
	}
	return a.watchTasks(ctx, c, []string{t.ID})
}

// wholeSeconds is a timeout flag's value in seconds; 0 when not given. The
// API counts timeouts in whole seconds, so a fraction is refused rather
// than rounded.
func wholeSeconds(flag string, d time.Duration) (int, error) {
	switch {
	case d < 0:
		return 0, usagef("%s must be positive, got %s", flag, d)
	case d%time.Second != 0:
		return 0, usagef("%s must be whole seconds, such as 90s or 10m, got %s", flag, d)
	}
	return int(d / time.Second), nil
}

// readPayload returns the payload given by --payload, --payload-file or a
// standard input that is not a terminal, checked to be a JSON object;
// nil when there is none.
func (a *app) readPayload(cmd *cobra.Command, payload, file string) (json.RawMessage, error) {
	var b []byte
	var err error
	source := "--payload"
	switch {
	case cmd.Flags().Changed("payload"):
		b = []byte(payload)
	case file == "-":
		source = "standard input"
		b, err = readAll(cmd.Context(), func() ([]byte, error) { return io.ReadAll(a.stdin) })
	case file != "":
		source = file
		b, err = readAll(cmd.Context(), func() ([]byte, error) { return os.ReadFile(file) })
	case a.stdin != nil && !a.stdinTerminal:
		source = "standard input"
		b, err = readAll(cmd.Context(), func() ([]byte, error) { return io.ReadAll(a.stdin) })
		if err == nil && len(bytes.TrimSpace(b)) == 0 {
			return nil, nil
		}
	default:
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the payload: %w", err)
	}
	return jsonObject("the payload ("+source+")", b)
}

// readAll calls read, which reads a file or standard input to its end,
// and returns what it read, or ctx's error once ctx is done: a pipe left
// open, or a FIFO nothing writes to, would otherwise keep the command
// waiting, deaf to Ctrl-C, which the command catches.
func readAll(ctx context.Context, read func() ([]byte, error)) ([]byte, error) {
	type result struct {
		b   []byte
		err error
	}
	got := make(chan result, 1)
	go func() {
		b, err := read()
		got <- result{b, err}
	}()
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case r := <-got:
		return r.b, r.err
	}
}

// jsonObject checks that b is one JSON object and returns it unparsed, so
// that its numbers reach the API as written: the API tells 1e2 from 100.
func jsonObject(what string, b []byte) (json.RawMessage, error) {
	b = bytes.TrimSpace(b)
	if !json.Valid(b) {
		return nil, usagef("%s is not valid JSON", what)
	}
	if len(b) == 0 || b[0] != '{' {
		return nil, usagef("%s must be a JSON object, {…}", what)
	}
	return json.RawMessage(b), nil
}

func (a *app) getCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "get ID",
		Short: "Show a task",
		Args:  exactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			t, err := c.Task(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, t.JSON())
			}
			return a.writeTask(t)
		},
	}
}

// writeTask writes a task as "key: value" lines.
func (a *app) writeTask(t apiclient.Task) error {
	attempt := fmt.Sprintf("%d of %d", t.Attempt, t.MaxAttempts)
	// A task waiting for its children runs again when the last one ends,
	// not at its next_run_at, which is when it went back to PENDING.
	awaiting := t.Status == apiclient.StatusPending && t.State == apiclient.StateAwaiting
	var next string
	if t.Status == apiclient.StatusPending && !awaiting {
		next = stampPtr(t.NextRunAt)
	}
	var waiting string
	switch {
	case t.Waiting && awaiting:
		waiting = "yes, for its children to finish"
	case t.Waiting:
		waiting = "yes, not yet admitted (a limit, a pause, or its turn in a busy type)"
	}
	return fields(a.stdout,
		"id", t.ID,
		"type", t.Type,
		"status", t.Status,
		"progress", strconv.Itoa(t.Progress)+"%",
		"state", t.State,
		"waiting", waiting,
		"error", t.Error,
		"attempt", attempt,
		"priority", strconv.Itoa(t.Priority),
		"visibility", strings.Join(t.Visibility, ", "),
		"idempotency key", t.IdempotencyKey,
		"concurrency key", t.ConcurrencyKey,
		"timeout", wholeDuration(t.TimeoutSeconds),
		"heartbeat timeout", wholeDuration(t.HeartbeatTimeoutSeconds),
		"job", t.JobID,
		"scheduled", stampPtr(t.ScheduledAt),
		"worker", t.WorkerID,
		"created", stamp(t.CreatedAt),
		"started", stampPtr(t.StartedAt),
		"next run", next,
		"cancel requested", stampPtr(t.CancelRequestedAt),
		"completed", stampPtr(t.CompletedAt),
		"updated", stampPtr(t.UpdatedAt),
		"payload", compact(t.Payload),
		"metadata", compact(t.Metadata),
		"result", compact(t.Result),
		"trace", t.TraceURL,
	)
}

func (a *app) listCommand() *cobra.Command {
	var (
		f       apiclient.ListFilter
		filters filterFlags
		all     bool
	)
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List tasks, newest first",
		Long: `List the tasks of the org that the caller may see, newest first, a page
at a time (--limit, up to 500; the API's default is 50). When there are
more, the command for the next page is printed on standard error; --all
fetches every page.

The filters combine: --status, --type, --created-after and --created-before
(each an RFC 3339 time, or a duration such as 1h or 30m meaning that long
ago), and --q (a task id, or key=value: the tasks whose metadata has that
key with that value, compared as text).`,
		Example: `  conveyor ls --status FAILED --type demo.sleep
  conveyor ls --created-after 1h --q team=billing
  conveyor ls --created-after 2026-11-01T00:00:00Z --created-before 2026-11-02T00:00:00Z
  conveyor ls --limit 500 --all -o json`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := limitFlag(cmd, f.Limit, 500); err != nil {
				return err
			}
			var err error
			if f.TaskFilter, err = filters.filter(a.now()); err != nil {
				return err
			}
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			var tasks []apiclient.Task
			// Not nil: a listing that matches nothing is written as the
			// API's empty list, [], never as null, which a script's
			// `jq '.tasks[]'` cannot iterate over.
			docs := []json.RawMessage{}
			for {
				page, err := c.Tasks(cmd.Context(), f)
				if err != nil {
					return err
				}
				if a.output == outputJSON && !all {
					return writeJSON(a.stdout, page.JSON())
				}
				tasks = append(tasks, page.Tasks...)
				var raw struct {
					Tasks []json.RawMessage `json:"tasks"`
				}
				if err := json.Unmarshal(page.JSON(), &raw); err != nil {
					return fmt.Errorf("the API's listing: %w", err)
				}
				docs = append(docs, raw.Tasks...)
				if all && page.NextCursor != "" && page.NextCursor == f.Cursor {
					// A server that answers the cursor it was sent would be
					// read forever.
					return fmt.Errorf("GET /v1/tasks: the API answered the cursor it was sent")
				}
				f.Cursor = page.NextCursor
				if f.Cursor == "" || !all {
					break
				}
			}
			if a.output == outputJSON {
				b, err := json.Marshal(map[string]any{"tasks": docs})
				if err != nil {
					return err
				}
				return writeJSON(a.stdout, b)
			}
			if err := a.writeTaskTable(tasks); err != nil {
				return err
			}
			if f.Cursor != "" {
				fmt.Fprintf(a.stderr, "more: %s\n", nextPage(cmd.CommandPath(), f))
			}
			return nil
		},
	}
	filters.register(cmd, statuses)
	fl := cmd.Flags()
	fl.IntVarP(&f.Limit, "limit", "n", 0, "tasks per page, 1 to 500 (default: the API's, 50)")
	fl.StringVar(&f.Cursor, "cursor", "", "start after this cursor, printed with the previous page")
	fl.BoolVarP(&all, "all", "A", false, "fetch every page")
	return cmd
}

// nextPage is the command that lists the next page: the cursor does not
// carry the filters, so they are repeated (times resolved, as sent).
func nextPage(command string, f apiclient.ListFilter) string {
	words := []string{command}
	add := func(flag, value string) {
		if value != "" {
			words = append(words, "--"+flag, shellWord(value))
		}
	}
	add("status", f.Status)
	add("type", f.Type)
	if !f.CreatedAfter.IsZero() {
		add("created-after", f.CreatedAfter.Format(time.RFC3339Nano))
	}
	if !f.CreatedBefore.IsZero() {
		add("created-before", f.CreatedBefore.Format(time.RFC3339Nano))
	}
	add("q", f.Q)
	if f.Limit > 0 {
		add("limit", strconv.Itoa(f.Limit))
	}
	add("cursor", f.Cursor)
	return strings.Join(words, " ")
}

// shellWord quotes s for a POSIX shell when it is not a plain word.
func shellWord(s string) string {
	if strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:=/+-") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// writeTaskTable writes tasks as a table.
func (a *app) writeTaskTable(tasks []apiclient.Task) error {
	now := a.now()
	t := newTable(a.stdout, "ID", "TYPE", "STATUS", "PROGRESS", "STATE", "AGE", "UPDATED")
	for _, task := range tasks {
		t.row(task.ID, task.Type, task.Status, strconv.Itoa(task.Progress)+"%", truncate(task.State, 40),
			ago(now, task.CreatedAt), agoPtr(now, task.UpdatedAt))
	}
	return t.flush()
}

func (a *app) cancelCommand() *cobra.Command {
	var b bulkFlags
	cmd := &cobra.Command{
		Use:   "cancel {ID | --all [filters]}",
		Short: "Cancel a task, or every task a filter matches",
		Long: `Cancel a task. A PENDING task is CANCELLED at once; for a running one the
cancellation is requested, and its handler stops within a second or so.
` + bulkHelp(cancelAll),
		Example: `  conveyor cancel 0193a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b
  conveyor cancel --all --type demo.sleep --status PENDING --created-after 1h
  conveyor cancel --all --q team=billing --dry-run
  conveyor cancel --all --type demo.sleep --yes`,
		Args: b.args,
		RunE: func(cmd *cobra.Command, args []string) error {
			if b.all {
				return a.runBulk(cmd, cancelAll, b)
			}
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			t, requested, err := c.Cancel(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, t.JSON())
			}
			if requested {
				_, err = fmt.Fprintf(a.stdout, "%s cancel requested (%s, %d%%)\n", t.ID, t.Status, t.Progress)
				return err
			}
			_, err = fmt.Fprintf(a.stdout, "%s %s\n", t.ID, t.Status)
			return err
		},
	}
	b.register(cmd, cancelAll)
	return cmd
}

func (a *app) retryCommand() *cobra.Command {
	var b bulkFlags
	cmd := &cobra.Command{
		Use:   "retry {ID | --all [filters]}",
		Short: "Run a FAILED or CANCELLED task again, or every one a filter matches",
		Long: `Run a FAILED or CANCELLED task again, from attempt 0.
` + bulkHelp(retryAll),
		Example: `  conveyor retry 0193a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b
  conveyor retry --all --status FAILED --type demo.sleep --created-after 24h`,
		Args: b.args,
		RunE: func(cmd *cobra.Command, args []string) error {
			if b.all {
				return a.runBulk(cmd, retryAll, b)
			}
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			t, err := c.Retry(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, t.JSON())
			}
			_, err = fmt.Fprintf(a.stdout, "%s %s (attempt %d of %d)\n", t.ID, t.Status, t.Attempt, t.MaxAttempts)
			return err
		},
	}
	b.register(cmd, retryAll)
	return cmd
}

// exactArgs wants n arguments, named by names in the message.
func exactArgs(n int, names string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) != n {
			return usagef("%s wants %s, got %d arguments", cmd.Name(), names, len(args))
		}
		return nil
	}
}

// limitFlag checks a --limit given against its range, 1 to most: a value
// outside it is not sent, and would silently list the API's default page.
func limitFlag(cmd *cobra.Command, limit, most int) error {
	if cmd.Flags().Changed("limit") && (limit < 1 || limit > most) {
		return usagef("--limit must be between 1 and %d, got %d", most, limit)
	}
	return nil
}

// noArgs refuses arguments.
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usagef("%s takes no arguments, got %q", cmd.Name(), args)
	}
	return nil
}
