package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

// filterFlags are the flags that select tasks: those of ls, and of cancel
// --all and retry --all.
type filterFlags struct {
	status, typ, createdAfter, createdBefore, q string
}

// filterFlagNames are the names of the filter flags.
var filterFlagNames = []string{"status", "type", "created-after", "created-before", "q"}

// register adds the filter flags to cmd; choices are the statuses
// --status may take there.
func (f *filterFlags) register(cmd *cobra.Command, choices []string) {
	fl := cmd.Flags()
	fl.StringVarP(&f.status, "status", "s", "", "only tasks of this status: "+strings.Join(choices, ", "))
	fl.StringVarP(&f.typ, "type", "t", "", "only tasks of this type")
	fl.StringVar(&f.createdAfter, "created-after", "", "only tasks created at or after this time: RFC 3339, or a duration back from now such as 1h")
	fl.StringVar(&f.createdBefore, "created-before", "", "only tasks created before this time: RFC 3339, or a duration back from now such as 30m")
	fl.StringVar(&f.q, "q", "", "only this task id, or the tasks whose metadata has key=value")
	_ = cmd.RegisterFlagCompletionFunc("status", fixedCompletions(choices...))
}

// filter is the API's filter the flags say, its times resolved against now.
func (f *filterFlags) filter(now time.Time) (apiclient.TaskFilter, error) {
	out := apiclient.TaskFilter{Status: strings.ToUpper(f.status), Type: f.typ, Q: f.q}
	var err error
	if out.CreatedAfter, err = timeFlag("created-after", f.createdAfter, now); err != nil {
		return apiclient.TaskFilter{}, err
	}
	if out.CreatedBefore, err = timeFlag("created-before", f.createdBefore, now); err != nil {
		return apiclient.TaskFilter{}, err
	}
	return out, nil
}

// timeFlag reads a time flag: an RFC 3339 time, or a positive duration
// meaning that long before now; "" is no time.
func timeFlag(name, v string, now time.Time) (time.Time, error) {
	if v == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
		if t.IsZero() {
			// The zero time is how the filter leaves a bound out: sent as
			// none, --created-before would select every task, as cancel
			// --all's filter.
			return time.Time{}, usagef("--%s must be later than 0001-01-01T00:00:00Z, got %q", name, v)
		}
		return t, nil
	}
	if d, err := time.ParseDuration(v); err == nil && d > 0 {
		return now.Add(-d).UTC(), nil
	}
	return time.Time{}, usagef("--%s %q is neither an RFC 3339 time such as 2026-01-02T15:04:05Z nor a duration back from now such as 1h or 30m", name, v)
}

// describe is the filter as people read it: "status=PENDING
// type=demo.sleep", "" when it has no field.
func describe(f apiclient.TaskFilter) string {
	var parts []string
	add := func(k, v string) {
		if v != "" {
			parts = append(parts, k+"="+v)
		}
	}
	add("status", f.Status)
	add("type", f.Type)
	add("created_after", stamp(f.CreatedAfter))
	add("created_before", stamp(f.CreatedBefore))
	if f.Q != "" {
		add("q", fmt.Sprintf("%q", f.Q))
	}
	return strings.Join(parts, " ")
}
