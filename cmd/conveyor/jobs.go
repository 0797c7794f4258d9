package main

import (
	"fmt"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

func (a *app) jobsCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "jobs",
		Short: "List the org's jobs; show, trigger, pause or resume one",
		Long: `List the org's jobs, which conveyor apply declares: their type, their
schedule and time zone ("-" for a job that runs only when triggered), when
the schedule next makes a task ("paused" or "inactive" when it does not),
and the job's limit on its tasks running at once ("-" for none).`,
		Example: `  conveyor jobs
  conveyor jobs get nightly-report
  conveyor jobs trigger nightly-report --payload '{"format":"csv"}' --wait
  conveyor jobs pause nightly-report`,
		Args: noArgs,
		RunE: a.listJobs,
	}
	cmd.AddCommand(&cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the org's jobs",
		Args:    noArgs,
		RunE:    a.listJobs,
	}, a.jobGetCommand(), a.jobTriggerCommand(), a.jobPauseCommand(true), a.jobPauseCommand(false))
	return cmd
}

func (a *app) listJobs(cmd *cobra.Command, _ []string) error {
	c, err := a.api(cmd)
	if err != nil {
		return err
	}
	l, err := c.Jobs(cmd.Context())
	if err != nil {
		return err
	}
	if a.output == outputJSON {
		return writeJSON(a.stdout, l.JSON())
	}
	now := a.now()
	t := newTable(a.stdout, "NAME", "TYPE", "SCHEDULE", "NEXT", "LIMIT")
	for _, j := range l.Jobs {
		t.row(j.Name, j.Type, jobSchedule(j), jobNext(now, j), limit(j.MaxConcurrency))
	}
	return t.flush()
}

// jobSchedule is a job's schedule and time zone, "-" when it runs only
// when triggered.
func jobSchedule(j apiclient.Job) string {
	if j.Source == nil {
		return "-"
	}
	return j.Source.Schedule + " " + j.Source.Timezone
}

// jobNext is when a job's schedule next makes a task, from now: "in 12s",
// or why it does not.
func jobNext(now time.Time, j apiclient.Job) string {
	switch {
	case !j.Active:
		return "inactive"
	case j.Paused:
		return "paused"
	case j.NextTickAt == nil:
		return "-"
	case !j.NextTickAt.After(now):
		return "due"
	}
	return "in " + age(j.NextTickAt.Sub(now))
}

// limit is a limit on tasks running at once, "-" for none.
func limit(n int) string {
	if n == 0 {
		return "-"
	}
	return strconv.Itoa(n)
}

func (a *app) jobGetCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "get NAME",
		Short: "Show a job",
		Args:  exactArgs(1, "NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			j, err := c.Job(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, j.JSON())
			}
			return a.writeJob(j)
		},
	}
}

// writeJob writes a job as "key: value" lines.
func (a *app) writeJob(j apiclient.Job) error {
	state := "active"
	switch {
	case !j.Active && j.Paused:
		state = "inactive, paused since " + stampPtr(j.PausedAt)
	case !j.Active:
		state = "inactive"
	case j.Paused:
		state = "paused since " + stampPtr(j.PausedAt)
	}
	var missed, next string
	if j.Source != nil {
		missed = j.Source.Missed
	}
	if j.NextTickAt != nil {
		next = stamp(*j.NextTickAt) + " (" + jobNext(a.now(), j) + ")"
	}
	perKey := ""
	if j.MaxConcurrencyPerKey > 0 {
		perKey = strconv.Itoa(j.MaxConcurrencyPerKey)
	}
	return fields(a.stdout,
		"name", j.Name,
		"id", j.ID,
		"type", j.Type,
		"state", state,
		"schedule", jobSchedule(j),
		"missed ticks", missed,
		"next", next,
		"priority", strconv.Itoa(j.Priority),
		"max attempts", strconv.Itoa(j.MaxAttempts),
		"timeout", wholeDuration(j.TimeoutSeconds),
		"heartbeat timeout", wholeDuration(j.HeartbeatTimeoutSeconds),
		"limit", limit(j.MaxConcurrency),
		"limit per key", perKey,
		"payload", compact(j.Payload),
		"config hash", j.ConfigHash,
		"created", stamp(j.CreatedAt),
		"updated", stamp(j.UpdatedAt),
	)
}

func (a *app) jobTriggerCommand() *cobra.Command {
	var (
		in                   apiclient.TriggerRequest
		payload, payloadFile string
		wait                 bool
	)
	cmd := &cobra.Command{
		Use:   "trigger NAME",
		Short: "Make a task of a job now and print its id",
		Long: `Make a task of the job NAME now, whatever its schedule, with the job's
payload, or the one --payload or --payload-file (- for standard input)
gives instead. With --wait, the task is then followed to its end, as
submit --wait does, and the exit status is 0 only if it COMPLETED.`,
		Example: `  conveyor jobs trigger nightly-report
  conveyor jobs trigger emails.digest --payload '{"user":42}' --concurrency-key user-42 --wait`,
		Args: exactArgs(1, "NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			// Unlike submit, standard input is read only when asked: the
			// job has a payload of its own.
			if cmd.Flags().Changed("payload") || payloadFile != "" {
				var err error
				if in.Payload, err = a.readPayload(cmd, payload, payloadFile); err != nil {
					return err
				}
			}
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			t, err := c.TriggerJob(cmd.Context(), args[0], in)
			if err != nil {
				return err
			}
			return a.writeNewTask(cmd.Context(), c, t, wait)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&payload, "payload", "p", "", "the payload, a JSON object, instead of the job's")
	f.StringVarP(&payloadFile, "payload-file", "f", "", "read the payload from this file (- for standard input)")
	f.StringVar(&in.ConcurrencyKey, "concurrency-key", "", "the group the per-key limits count the task in")
	f.BoolVarP(&wait, "wait", "w", false, "follow the task to its end; exit 0 only if it COMPLETED")
	cmd.MarkFlagsMutuallyExclusive("payload", "payload-file")
	return cmd
}

// jobPauseCommand is jobs pause, or with pause false jobs resume.
func (a *app) jobPauseCommand(pause bool) *cobra.Command {
	use, short, done := "resume NAME", "Resume a paused job", "resumed"
	if pause {
		use, short, done = "pause NAME", "Pause a job: its schedule stops, its tasks not yet started wait", "paused"
	}
	return &cobra.Command{
		Use:   use,
		Short: short,
		Args:  exactArgs(1, "NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			change := c.ResumeJob
			if pause {
				change = c.PauseJob
			}
			j, err := change(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, j.JSON())
			}
			msg := "job " + j.Name + " " + done
			if !pause && j.NextTickAt != nil {
				msg += " (next tick " + jobNext(a.now(), j) + ")"
			}
			_, err = fmt.Fprintln(a.stdout, msg)
			return err
		},
	}
}

func (a *app) typesCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "types",
		Short: "List the task types the org limits or pauses; pause or resume one",
		Long: `List the task types the org has limited (conveyor apply, under types:) or
paused: how many of their tasks may run at once ("-" for no limit), how
many per concurrency key, and whether they are paused. A paused type's
tasks not yet started wait; running ones finish.`,
		Example: `  conveyor types
  conveyor types pause emails.send
  conveyor types resume emails.send`,
		Args: noArgs,
		RunE: a.listTypes,
	}
	cmd.AddCommand(&cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the task types the org limits or pauses",
		Args:    noArgs,
		RunE:    a.listTypes,
	}, a.typePauseCommand(true), a.typePauseCommand(false))
	return cmd
}

func (a *app) listTypes(cmd *cobra.Command, _ []string) error {
	c, err := a.api(cmd)
	if err != nil {
		return err
	}
	l, err := c.Types(cmd.Context())
	if err != nil {
		return err
	}
	if a.output == outputJSON {
		return writeJSON(a.stdout, l.JSON())
	}
	now := a.now()
	t := newTable(a.stdout, "TYPE", "LIMIT", "PER-KEY", "PAUSED")
	for _, s := range l.Types {
		paused := "no"
		switch {
		case s.Paused && s.PausedAt != nil:
			paused = "yes, " + ago(now, *s.PausedAt) + " ago"
		case s.Paused:
			paused = "yes"
		}
		t.row(s.Type, limit(s.MaxConcurrency), limit(s.MaxConcurrencyPerKey), paused)
	}
	return t.flush()
}

// typePauseCommand is types pause, or with pause false types resume.
func (a *app) typePauseCommand(pause bool) *cobra.Command {
	use, short, done := "resume TYPE", "Resume a paused task type", "resumed"
	if pause {
		use, short, done = "pause TYPE", "Pause a task type: its tasks not yet started wait; running ones finish", "paused"
	}
	return &cobra.Command{
		Use:   use,
		Short: short,
		Args:  exactArgs(1, "TYPE"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			change := c.ResumeType
			if pause {
				change = c.PauseType
			}
			s, err := change(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, s.JSON())
			}
			_, err = fmt.Fprintf(a.stdout, "type %s %s\n", s.Type, done)
			return err
		},
	}
}
