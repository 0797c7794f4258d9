package job

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/robfig/cron/v3"
)

// cronParser accepts 5 fields, 6 with seconds first, and descriptors such
// as @daily and @every 1m.
var cronParser = cron.NewParser(cron.SecondOptional | cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

const everyPrefix = "@every "

// Schedule parses a cron spec that runs in the named time zone ("" is UTC).
// It refuses "@every" intervals under a second or not a whole number of
// seconds (cron would silently round them), specs carrying their own TZ= or
// CRON_TZ= prefix (the time zone is a field of its own), and specs that
// never fire, such as "0 0 30 2 *".
func Schedule(spec, timezone string) (s cron.Schedule, err error) {
	spec = strings.TrimSpace(spec)
	if spec == "" {
		return nil, errors.New("schedule is empty")
	}
	if strings.HasPrefix(spec, "TZ=") || strings.HasPrefix(spec, "CRON_TZ=") {
		return nil, fmt.Errorf("invalid schedule %q: give the time zone in the timezone field, not as a TZ= or CRON_TZ= prefix", spec)
	}
	loc, err := location(timezone)
	if err != nil {
		return nil, err
	}
	if rest, ok := strings.CutPrefix(spec, everyPrefix); ok {
		d, err := time.ParseDuration(strings.TrimSpace(rest))
		if err != nil {
			return nil, fmt.Errorf("invalid schedule %q: %q is not a duration such as 30s, 5m or 1h", spec, strings.TrimSpace(rest))
		}
		if d < time.Second {
			return nil, fmt.Errorf("invalid schedule %q: the interval must be at least 1s", spec)
		}
		if d%time.Second != 0 {
			return nil, fmt.Errorf("invalid schedule %q: the interval must be a whole number of seconds", spec)
		}
	}
	// The parser is third-party code fed with user input: a panic in it
	// must not take the API down.
	defer func() {
		if r := recover(); r != nil {
			s, err = nil, fmt.Errorf("invalid schedule %q: %v", spec, r)
		}
	}()
	s, err = cronParser.Parse(spec)
	if err != nil {
		return nil, fmt.Errorf("invalid schedule %q: %w", spec, err)
	}
	if ss, ok := s.(*cron.SpecSchedule); ok {
		ss.Location = loc
		// SpecSchedule.Next gives up after five years and returns the zero
		// time; every real date recurs within that, so a zero here means
		// the spec names a day that does not exist.
		if ss.Next(time.Now()).IsZero() {
			return nil, fmt.Errorf("invalid schedule %q: it never fires", spec)
		}
	}
	return s, nil
}

// Ticks returns the times s fires in (after, until], in order, at most
// limit of them, and whether it fires more often than that in the window.
func Ticks(s cron.Schedule, after, until time.Time, limit int) (ticks []time.Time, more bool) {
	for t := after; ; {
		next := s.Next(t)
		// Zero: the schedule gave up. Not after t: a schedule that does not
		// move forward would loop for ever.
		if next.IsZero() || !next.After(t) || next.After(until) {
			return ticks, false
		}
		if len(ticks) >= limit {
			return ticks, true
		}
		ticks = append(ticks, next)
		t = next
	}
}
