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

// maxLookBack bounds how far back Latest searches from its end before it
// walks from its start instead; it keeps the doubling search within the
// range of a time.Duration.
const maxLookBack = 100 * 365 * 24 * time.Hour

// Latest returns the latest time s fires in [from, until], from counting as
// a time it fires (a job's cursor, its first tick not yet made), or false
// when from is after until. It searches back from until in windows that
// double, so that a long pause of a frequent schedule walks only the ticks
// near its end.
func Latest(s cron.Schedule, from, until time.Time) (time.Time, bool) {
	if from.After(until) {
		return time.Time{}, false
	}
	if c, ok := s.(cron.ConstantDelaySchedule); ok && c.Delay > 0 {
		// "@every" ticks are the cursor plus whole intervals.
		return from.Add(until.Sub(from) / c.Delay * c.Delay), true
	}
	walk := func(t, latest time.Time) time.Time {
		for {
			next := s.Next(t)
			if next.IsZero() || !next.After(t) || next.After(until) {
				return latest
			}
			latest, t = next, next
		}
	}
	for d := time.Second; d < maxLookBack; d *= 2 {
		start := until.Add(-d)
		if !start.After(from) {
			break
		}
		if next := s.Next(start); !next.IsZero() && !next.After(until) {
			return walk(start, from), true
		}
	}
	return walk(from, from), true
}

// ResumeCursor returns where the schedule s of a job resumed at now, whose
// cursor was next, starts again. The ticks that passed while the job was
// paused were missed, however recent: with missed skip the cursor moves
// to the first tick after now, and with run_once to the latest tick that
// passed, the one task the pause is owed. A cursor still ahead stays.
func ResumeCursor(s cron.Schedule, next, now time.Time, missed string) time.Time {
	if next.After(now) {
		return next
	}
	if missed == MissedSkip {
		return s.Next(now)
	}
	latest, _ := Latest(s, next, now)
	return latest
}
