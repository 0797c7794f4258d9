package main

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

func (a *app) overviewCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "overview",
		Short: "Show the org's tasks at a glance, and the workers",
		Long: `Show the tasks per status, what completed and failed in the last hour,
the queue of each type with tasks waiting or running (WAITING: due;
SCHEDULED: not due yet, in a retry's backoff or submitted with a later
--run-at or --delay; OLDEST: the longest wait of a due task), the
outbox's backlog, and the workers heard from within the last minute (the
maintenance leader marked), with how many of the org's tasks each runs. With -o json, the API's document as it came, the last
hour minute by minute and the tasks each worker runs included.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			o, err := c.Overview(cmd.Context())
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, o.JSON())
			}
			return a.writeOverview(o)
		},
	}
}

// writeOverview writes the overview as text: the counts and the last hour,
// the queues, the outbox, the workers.
func (a *app) writeOverview(o apiclient.Overview) error {
	now := a.now()
	// A large org's overview is shared by its callers for a few seconds.
	asOf := ""
	if !o.AsOf.IsZero() {
		asOf = o.AsOf.Local().Format(time.TimeOnly)
	}
	if err := fields(a.stdout,
		"as of", asOf,
		"tasks", counts(o.Counts),
		"last hour", fmt.Sprintf("%d completed, %d failed, %.2f completed per minute",
			o.LastHour.Completed, o.LastHour.Failed, o.LastHour.ThroughputPerMinute),
	); err != nil {
		return err
	}

	fmt.Fprintf(a.stdout, "\n")
	if len(o.Queues) == 0 {
		fmt.Fprintf(a.stdout, "no task is waiting or running\n")
	} else {
		t := newTable(a.stdout, "TYPE", "WAITING", "SCHEDULED", "RUNNING", "OLDEST")
		for _, q := range o.Queues {
			oldest := ""
			if q.Pending > 0 {
				oldest = age(seconds(q.OldestPendingAgeSeconds))
			}
			t.row(q.Type, strconv.Itoa(q.Pending), strconv.Itoa(q.Scheduled), strconv.Itoa(q.Running), oldest)
		}
		if err := t.flush(); err != nil {
			return err
		}
	}

	fmt.Fprintf(a.stdout, "\n")
	outbox := fmt.Sprintf("%d due", o.Outbox.Depth)
	if o.Outbox.Depth > 0 {
		outbox += ", the oldest for " + age(seconds(o.Outbox.OldestAgeSeconds))
	}
	fmt.Fprintf(a.stdout, "outbox: %s, %d parked (waiting for a worker of their type)\n", outbox, o.Outbox.Parked)

	fmt.Fprintf(a.stdout, "\n")
	if len(o.Workers) == 0 {
		_, err := fmt.Fprintf(a.stdout, "no worker heard from in the last minute\n")
		return err
	}
	t := newTable(a.stdout, "ID", "HOST", "TYPES", "CONCURRENCY", "HEARTBEAT", "RUNNING")
	for _, w := range o.Workers {
		id := w.ID
		if w.ID == o.Leader {
			id += " (leader)"
		}
		t.row(id, w.Hostname, strings.Join(w.Types, ","), strconv.Itoa(w.Concurrency),
			ago(now, w.LastHeartbeatAt), strconv.Itoa(len(w.Running)))
	}
	return t.flush()
}

// counts is the tasks per status on one line, in the order of the
// lifecycle (statuses the CLI does not know last, by name).
func counts(c map[string]int) string {
	order := slices.Clone(statuses)
	for _, s := range slices.Sorted(maps.Keys(c)) {
		if !slices.Contains(order, s) {
			order = append(order, s)
		}
	}
	parts := make([]string, len(order))
	for i, s := range order {
		parts[i] = fmt.Sprintf("%s %d", s, c[s])
	}
	return strings.Join(parts, "  ")
}

// seconds is a number of seconds as a duration.
func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
