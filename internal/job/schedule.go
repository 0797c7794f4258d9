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
		if ss.Hour&allHours != allHours {
			wall := *ss
			wall.Location = time.UTC
			return wallClock{wall: &wall, loc: loc}, nil
		}
	}
	return s, nil
}

// allHours is a cron hour field that names every hour.
const allHours = 1<<24 - 1

// dstSlack is more than any change of a time zone's clocks.
const dstSlack = 3 * time.Hour

// wallClock is a schedule at set hours of the day: it fires once at each
// local time its spec names, even on the days the clocks change. A time
// that a spring-forward skips fires as the clocks jump past it (02:30
// becomes 03:30); a time that a fall-back repeats fires at its first
// occurrence only. robfig/cron would fire such a time on no day and on two,
// losing a nightly job's run or doubling it (and it loses a day's tick
// where the clocks move by half an hour). A schedule that runs every hour
// keeps robfig's real-time ticks: its repeated hour is another hour of
// work, and its skipped one is no time at all.
type wallClock struct {
	// wall is the spec on wall-clock times written as UTC.
	wall *cron.SpecSchedule
	loc  *time.Location
}

// wallTime is t's local time in loc, written as UTC.
func wallTime(t time.Time, loc *time.Location) time.Time {
	l := t.In(loc)
	return time.Date(l.Year(), l.Month(), l.Day(), l.Hour(), l.Minute(), l.Second(), 0, time.UTC)
}

// at returns when the wall-clock time w first happens in the schedule's
// zone, or, when the clocks jumped over it, false and the wall-clock time
// the jump landed on.
func (s wallClock) at(w time.Time) (time.Time, bool, time.Time) {
	_, before := w.Add(-24 * time.Hour).In(s.loc).Zone()
	_, after := w.Add(24 * time.Hour).In(s.loc).Zone()
	c1 := w.Add(-time.Duration(before) * time.Second)
	c2 := w.Add(-time.Duration(after) * time.Second)
	ok1, ok2 := wallTime(c1, s.loc).Equal(w), wallTime(c2, s.loc).Equal(w)
	switch {
	case ok1 && (!ok2 || c1.Before(c2)):
		return c1, true, time.Time{}
	case ok2:
		return c2, true, time.Time{}
	}
	jump, _ := c1.In(s.loc).ZoneBounds()
	return time.Time{}, false, wallTime(jump, s.loc)
}

// Next returns the first time after t the schedule fires.
func (s wallClock) Next(t time.Time) time.Time {
	// The first wall-clock tick after t's that happens after t: a time the
	// clocks jumped over is left to the loop below, and past a repeated
	// stretch's first occurrence the search goes on after the stretch.
	var best time.Time
	for n := s.wall.Next(wallTime(t, s.loc)); !n.IsZero(); {
		r, ok, landed := s.at(n)
		if ok && r.After(t) {
			best = r
			break
		}
		from := n
		if !ok && landed.After(from) {
			from = landed.Add(-time.Second)
		} else if ok {
			if start, _ := t.In(s.loc).ZoneBounds(); !start.IsZero() {
				if end := wallTime(start.Add(-time.Second), s.loc); end.After(from) {
					from = end
				}
			}
		}
		n = s.wall.Next(from)
	}
	// A time inside a gap the clocks jumped over, from a gap that may still
	// hold one after t up to the tick above, fires that far after the jump.
	at := t.Add(-dstSlack).In(s.loc)
	for {
		_, jump := at.ZoneBounds()
		if jump.IsZero() || (!best.IsZero() && jump.After(best)) || jump.Sub(t) > 5*366*24*time.Hour {
			break
		}
		_, before := jump.Add(-time.Second).Zone()
		_, after := jump.Zone()
		if gap := time.Duration(after-before) * time.Second; gap > 0 {
			// The wall-clock times [w0, w0+gap) never happened.
			w0 := wallTime(jump.Add(-time.Second), s.loc).Add(time.Second)
			from := w0.Add(-time.Second)
			if d := t.Sub(jump); d >= 0 {
				from = w0.Add(d)
			}
			if g := s.wall.Next(from); !g.IsZero() && g.Before(w0.Add(gap)) {
				if c := jump.Add(g.Sub(w0)); best.IsZero() || c.Before(best) {
					best = c
				}
			}
		}
		at = jump
	}
	if best.IsZero() {
		return best
	}
	return best.In(t.Location())
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
