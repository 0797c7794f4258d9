package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

func (a *app) eventsCommand() *cobra.Command {
	var (
		limit  int
		cursor string
		all    bool
		follow bool
		filter apiclient.EventFilter
	)
	cmd := &cobra.Command{
		Use:   "events [ID]",
		Short: "Show a task's events, or follow events live",
		Long: `Show a task's most recent events (--limit, up to 100; the API's default
is 50), oldest first; with -o json, as the API answers them, newest first.
When it has older events, the command for the page before is printed on
standard error; --all fetches every page: the task's whole history.

With --follow and an ID, print the task's events from its first, one line
each, and go on live until the task ends (exit 1 if it did not COMPLETE,
as watch). With --follow and no ID, print
the org's events from now on, one line each, until Ctrl-C; --type and
--status narrow them. With -o json, each event is a JSON line.`,
		Example: `  conveyor events 0193a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b
  conveyor events 0193a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b --all
  conveyor events --follow --type demo.sleep --status FAILED`,
		Args: func(cmd *cobra.Command, args []string) error {
			switch {
			case len(args) > 1:
				return usagef("events takes one task ID, got %d arguments", len(args))
			case len(args) == 0 && !follow:
				return usagef("events wants a task ID, or --follow for the org's live events")
			case len(args) == 1 && (filter.Type != "" || filter.Status != ""):
				return usagef("--type and --status narrow the org's live events (events --follow without an ID)")
			case follow && (cmd.Flags().Changed("limit") || cursor != "" || all):
				return usagef("--limit, --cursor and --all are for a task's history, not with --follow")
			}
			return limitFlag(cmd, limit, 100)
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			switch {
			case follow && len(args) == 1:
				v := a.feedView(false)
				status, err := c.FollowTask(ctx, args[0], func(e apiclient.Event) error { v.event(0, e); return nil })
				if err == nil && status != apiclient.StatusCompleted {
					// As watch and submit --wait: the task followed to its
					// end did not complete.
					return &exitStatus{code: exitFailure}
				}
				return err
			case follow:
				filter.Status = strings.ToUpper(filter.Status)
				v := a.feedView(true)
				err := c.FollowEvents(ctx, filter, func(e apiclient.Event) error { v.event(0, e); return nil })
				if errors.Is(err, context.Canceled) {
					// Ctrl-C is how a feed is meant to end.
					return nil
				}
				return err
			}
			var events []apiclient.Event
			// Not nil: a task without events is written as [], as the API
			// answers.
			docs := []json.RawMessage{}
			for {
				page, err := c.Events(ctx, args[0], limit, cursor)
				if err != nil {
					return err
				}
				if a.output == outputJSON && !all {
					return writeJSON(a.stdout, page.JSON())
				}
				events = append(events, page.Events...)
				var raw struct {
					Events []json.RawMessage `json:"events"`
				}
				if err := json.Unmarshal(page.JSON(), &raw); err != nil {
					return fmt.Errorf("the API's events: %w", err)
				}
				docs = append(docs, raw.Events...)
				if all && page.NextCursor != "" && page.NextCursor == cursor {
					// A server that answers the cursor it was sent would be
					// read forever.
					return fmt.Errorf("GET /v1/tasks/%s/events: the API answered the cursor it was sent", args[0])
				}
				cursor = page.NextCursor
				if cursor == "" || !all {
					break
				}
			}
			if a.output == outputJSON {
				b, err := json.Marshal(map[string]any{"events": docs})
				if err != nil {
					return err
				}
				return writeJSON(a.stdout, b)
			}
			if err := a.writeEventTable(events); err != nil {
				return err
			}
			if cursor != "" {
				words := []string{cmd.CommandPath(), shellWord(args[0])}
				if limit > 0 {
					words = append(words, "--limit", strconv.Itoa(limit))
				}
				fmt.Fprintf(a.stderr, "more: %s\n", strings.Join(append(words, "--cursor", shellWord(cursor)), " "))
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.IntVarP(&limit, "limit", "n", 0, "events per page, 1 to 100 (default: the API's, 50)")
	f.StringVar(&cursor, "cursor", "", "show the events before this cursor, printed with the previous page")
	f.BoolVarP(&all, "all", "A", false, "fetch every page: the task's whole history")
	f.BoolVarP(&follow, "follow", "f", false, "follow live: the task's events to its end, or without ID the org's")
	f.StringVarP(&filter.Type, "type", "t", "", "with --follow and no ID: only events of tasks of this type")
	f.StringVarP(&filter.Status, "status", "s", "", "with --follow and no ID: only events of this status")
	_ = cmd.RegisterFlagCompletionFunc("status", fixedCompletions(statuses...))
	return cmd
}

// feedView prints followed events one line each, or as JSON lines.
func (a *app) feedView(withType bool) view {
	if a.output == outputJSON {
		return &jsonView{w: a.stdout}
	}
	return &lineView{w: a.stdout, withType: withType}
}

// writeEventTable writes events, which the API lists newest first, as a
// table oldest first.
func (a *app) writeEventTable(events []apiclient.Event) error {
	t := newTable(a.stdout, "ID", "TIME", "STATUS", "PROGRESS", "ACTOR", "BY", "STATE", "ERROR")
	for _, e := range slices.Backward(events) {
		t.row(strconv.FormatInt(e.ID, 10), stamp(e.CreatedAt), e.Status, strconv.Itoa(e.Progress)+"%",
			e.Actor, principal(e.By), e.State, e.Error)
	}
	return t.flush()
}

// principal names who made a change: a user's email or subject, a key's
// name.
func principal(p *apiclient.Principal) string {
	if p == nil {
		return ""
	}
	if p.Name != "" {
		return p.Kind + " " + p.Name
	}
	return p.Kind + " " + p.ID
}
