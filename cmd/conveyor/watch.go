package main

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/mattn/go-runewidth"
	"github.com/spf13/cobra"
	"github.com/vbauerster/mpb/v8"
	"github.com/vbauerster/mpb/v8/decor"
	"golang.org/x/term"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

func (a *app) watchCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "watch ID...",
		Short: "Follow tasks live to their end, with a progress bar each",
		Long: `Follow each task through its live stream, from its first event to its
end: on a terminal with a line for each task, one progress bar per task
with its state, the time since it was submitted and an estimate of the
time left; otherwise one line per event (time, task, status, progress,
state); with -o json, each event as a JSON line. A dropped stream is
resumed where it stopped.

The exit status is 0 when every task COMPLETED, 1 when one FAILED, was
CANCELLED or could not be followed, 130 when interrupted.`,
		Example: `  conveyor watch 0193a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b
  conveyor ls --status IN_PROGRESS -o json | jq -r '.tasks[].id' | xargs conveyor watch`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usagef("watch wants at least one task ID")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			return a.watchTasks(cmd.Context(), c, args)
		},
	}
}

// taskEnd is how following a task ended.
type taskEnd struct {
	// status is the task's final status; "" when it could not be followed.
	status string
	// taskErr is the task's error, when it FAILED.
	taskErr string
	// err says why the task could not be followed to its end.
	err error
}

// final is the end as people read it: "COMPLETED", "FAILED: error".
func (r taskEnd) final() string {
	switch {
	case errors.Is(r.err, context.Canceled):
		return "interrupted"
	case r.err != nil:
		return "error: " + r.err.Error()
	case r.status == apiclient.StatusFailed && r.taskErr != "":
		return r.status + ": " + r.taskErr
	}
	return r.status
}

// watchTasks follows every task to its end at once, showing them on one
// view; it succeeds when all of them COMPLETED.
func (a *app) watchTasks(ctx context.Context, c *apiclient.Client, ids []string) error {
	v := a.newView(ids)
	ends := make([]taskEnd, len(ids))
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Go(func() {
			ends[i] = followTask(ctx, c, id, func(e apiclient.Event) { v.event(i, e) })
			v.end(i, ends[i])
		})
	}
	wg.Wait()
	v.close()
	if err := ctx.Err(); err != nil {
		return err
	}
	ok, unauthorized, unreachable := true, false, false
	for i, r := range ends {
		if r.err != nil {
			fmt.Fprintf(a.stderr, "conveyor: task %s: %v\n", ids[i], r.err)
		}
		ok = ok && r.err == nil && r.status == apiclient.StatusCompleted
		unauthorized = unauthorized || apiclient.StatusOf(r.err) == 401
		unreachable = unreachable || apiclient.Unreachable(r.err)
	}
	if unauthorized {
		fmt.Fprintf(a.stderr, "conveyor: %s\n", keyHint)
	}
	if unreachable {
		fmt.Fprintf(a.stderr, "conveyor: %s\n", urlHint)
	}
	if !ok {
		return &exitStatus{code: exitFailure}
	}
	return nil
}

// followTask follows a task to its end, passing each of its events to show.
func followTask(ctx context.Context, c *apiclient.Client, id string, show func(apiclient.Event)) taskEnd {
	var last apiclient.Event
	status, err := c.FollowTask(ctx, id, func(e apiclient.Event) error {
		last = e
		show(e)
		return nil
	})
	if err != nil {
		return taskEnd{err: err}
	}
	r := taskEnd{status: status, taskErr: last.Error}
	if status == apiclient.StatusFailed && r.taskErr == "" {
		// An event written before events kept their error: ask the task.
		if t, err := c.Task(ctx, id); err == nil {
			r.taskErr = t.Error
		}
	}
	return r
}

// view shows the events of followed tasks, each known by its index.
type view interface {
	event(i int, e apiclient.Event)
	end(i int, r taskEnd)
	// close waits until the final screen is shown.
	close()
}

// newView is the view for the output: bars on a terminal that can move
// its cursor, else lines, or JSON lines.
func (a *app) newView(ids []string) view {
	switch {
	case a.output == outputJSON:
		return &jsonView{w: a.stdout}
	case isTerminal(a.stdout) && a.getenv("TERM") != "dumb" && fitsBars(a.stdout, len(ids)):
		return newBarView(a.stdout, ids, a.now)
	default:
		return &lineView{w: a.stdout}
	}
}

// fitsBars reports whether the terminal w has room for n bars below one
// another, and the line the cursor waits on: mpb draws only the bars that
// fit, and never the others, the first tasks'.
func fitsBars(w any, n int) bool {
	f, ok := w.(interface{ Fd() uintptr })
	if !ok {
		return true
	}
	_, rows, err := term.GetSize(int(f.Fd()))
	return err != nil || rows == 0 || n < rows
}

// lineView writes one line per event.
type lineView struct {
	mu sync.Mutex
	w  io.Writer
	// withType adds each event's task type, for feeds of many types.
	withType bool
}

func (v *lineView) event(_ int, e apiclient.Event) {
	v.mu.Lock()
	defer v.mu.Unlock()
	fmt.Fprintf(v.w, "%s\n", eventLine(e, v.withType))
}

func (v *lineView) end(int, taskEnd) {}
func (v *lineView) close()           {}

// eventLine is an event on one line: time, task, [type,] status,
// progress, state and the error it set.
func eventLine(e apiclient.Event, withType bool) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s  %s  ", stamp(e.CreatedAt), e.TaskID)
	if withType {
		fmt.Fprintf(&b, "%s  ", e.Type)
	}
	fmt.Fprintf(&b, "%-11s %3d%%  %s", e.Status, e.Progress, e.State)
	if e.Error != "" {
		fmt.Fprintf(&b, ": %s", e.Error)
	}
	return strings.TrimRight(oneLine(b.String()), " ")
}

// jsonView writes each event as the API sent it, one per line.
type jsonView struct {
	mu sync.Mutex
	w  io.Writer
}

func (v *jsonView) event(_ int, e apiclient.Event) {
	v.mu.Lock()
	defer v.mu.Unlock()
	_ = writeJSONLine(v.w, e.JSON())
}

func (v *jsonView) end(int, taskEnd) {}
func (v *jsonView) close()           {}

// barView draws a progress bar per task, redrawn in place.
type barView struct {
	p    *mpb.Progress
	w    io.Writer
	bars []*taskBar
}

const (
	// barWidth is the widest a bar is drawn.
	barWidth = 30
	// minBarWidth is the narrowest, on a narrow terminal.
	minBarWidth = 12
	// textWidth is the room the text after a bar gets, at least, before
	// the bar narrows.
	textWidth = 36
	// wideLine is the width of a line from which a task is labelled by its
	// whole id, not only the end of it.
	wideLine = 110
)

func newBarView(w io.Writer, ids []string, now func() time.Time) *barView {
	opts := []mpb.ContainerOption{mpb.WithOutput(w), mpb.WithWidth(barWidth), mpb.WithRefreshRate(100 * time.Millisecond)}
	if f, ok := w.(interface{ Fd() uintptr }); ok {
		opts = append(opts, mpb.WithConsoleWriter(&barWriter{out: w, fd: int(f.Fd())}))
	}
	v := &barView{w: w, p: mpb.New(opts...)}
	for _, id := range ids {
		tb := &taskBar{id: id, now: now}
		// Total 0: the bar completes only when told, not when a task
		// reports 100% before it is COMPLETED; SetTotal scales it.
		tb.bar = v.p.New(0, mpb.BarStyle().Lbound("[").Filler("=").Tip(">").Padding("-").Rbound("]"),
			mpb.PrependDecorators(decor.Any(tb.label, decor.WCSyncSpaceR)),
			mpb.AppendDecorators(decor.Any(tb.suffix)))
		tb.bar.SetTotal(100, false)
		v.bars = append(v.bars, tb)
	}
	return v
}

func (v *barView) event(i int, e apiclient.Event) { v.bars[i].event(e) }

func (v *barView) end(i int, r taskEnd) {
	tb := v.bars[i]
	tb.mu.Lock()
	tb.ended = &r
	tb.mu.Unlock()
	if r.status == apiclient.StatusCompleted {
		tb.bar.SetTotal(100, true)
	} else {
		tb.bar.Abort(false)
	}
}

// close waits for the last frame, then writes in full the errors of the
// tasks that failed, which their bars may have cut.
func (v *barView) close() {
	v.p.Wait()
	for _, tb := range v.bars {
		if r := tb.ended; r != nil && r.status == apiclient.StatusFailed && r.taskErr != "" {
			// Whole, but on one line and harmless on the terminal, as
			// every other line that shows a task's text.
			fmt.Fprintf(v.w, "%s %s\n", tb.id, oneLine(r.final()))
		}
	}
}

// barWriter writes the bars' frames to a terminal, each over the one
// before. mpb's own writer moves the cursor up without going back to the
// first column, so the "^C" a terminal echoes at an interrupt, below the
// bars, shifts the last frame two columns to the right: its lines, as wide
// as the terminal, then wrap and overwrite each other. This one returns to
// the first column before it moves up, as liveScreen does for runs.
type barWriter struct {
	bytes.Buffer
	out io.Writer
	fd  int
}

func (w *barWriter) IsTerminal() bool { return true }

func (w *barWriter) GetTermSize() (width, height int, err error) { return term.GetSize(w.fd) }

// Flush writes the frame buffered, and starts the next one by going back
// over the lines of this one, which mpb counts.
func (w *barWriter) Flush(lines int) error {
	if _, err := w.WriteTo(w.out); err != nil {
		return err
	}
	if lines > 0 {
		fmt.Fprintf(&w.Buffer, "\r\x1b[%dA\x1b[J", lines)
	}
	return nil
}

// taskBar is one task's bar and what its text shows.
type taskBar struct {
	id  string
	bar *mpb.Bar
	now func() time.Time

	mu       sync.Mutex
	typ      string
	status   string
	state    string
	taskErr  string
	progress int
	// created, attemptStart and lastAt are the server's times of the
	// task's first event, of the start of its running attempt and of its
	// last event; lastSeen is when the last event arrived here. Durations
	// are measured between the server's times, and from lastSeen on the
	// local clock, so the two clocks need not agree.
	created, attemptStart, lastAt, lastSeen time.Time
	ended                                   *taskEnd
}

func (b *taskBar) event(e apiclient.Event) {
	b.mu.Lock()
	if b.created.IsZero() {
		b.created = e.CreatedAt
	}
	if e.Status == apiclient.StatusInProgress && b.status != apiclient.StatusInProgress {
		b.attemptStart = e.CreatedAt
	}
	b.typ = cmp.Or(e.Type, b.typ)
	b.status, b.state, b.taskErr, b.progress = e.Status, e.State, e.Error, e.Progress
	b.lastAt, b.lastSeen = e.CreatedAt, b.now()
	b.mu.Unlock()
	b.bar.SetCurrent(int64(e.Progress))
}

// label is the task's id and type, before its bar; on a narrow terminal,
// the end of its id (the start of an id is its time, which tasks
// submitted together share).
func (b *taskBar) label(s decor.Statistics) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	id := b.id
	if s.AvailableWidth < wideLine && len(id) > 9 {
		id = "…" + id[len(id)-8:]
	}
	// Cut, so that a long type leaves the bar and the progress room: a
	// line wider than the terminal is cut at its end, where they are.
	return truncate(strings.TrimSpace(id+" "+b.typ), max(s.AvailableWidth-2-minBarWidth-6, 9))
}

// suffix is the text after the bar: progress, times, then the state, or
// the final status once the task ended. It always takes the same width
// (cut or padded), so that the bar, which gets the rest of the line, keeps
// its width while the text changes.
func (b *taskBar) suffix(s decor.Statistics) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	progress := b.progress
	if b.ended != nil && b.ended.status == apiclient.StatusCompleted {
		progress = 100
	}
	var state string
	switch {
	case b.ended != nil:
		state = b.ended.final()
	case b.status == "":
		state = "connecting"
	case b.status == apiclient.StatusInProgress:
		state = b.state
	default:
		state = b.status + " " + b.state
		if b.taskErr != "" {
			state += ": " + b.taskErr
		}
	}
	parts := []string{fmt.Sprintf("%3d%%", progress)}
	for _, p := range []string{b.timing(), state} {
		if p != "" {
			parts = append(parts, p)
		}
	}
	// A newline would push the bars below down a line, which mpb, counting
	// a line a bar, would not draw over.
	text := oneLine(strings.Join(parts, "  "))
	room := s.AvailableWidth - 2 // the spaces around the bar
	width := max(room-barWidth, min(room-minBarWidth, textWidth), 0)
	text = truncate(text, width)
	return text + strings.Repeat(" ", max(width-runewidth.StringWidth(text), 0))
}

// timing is the time since the task was submitted and, while it runs,
// the time its progress so far says is left.
func (b *taskBar) timing() string {
	if b.created.IsZero() {
		return ""
	}
	since := b.lastAt.Sub(b.created)
	if b.ended == nil {
		since += b.now().Sub(b.lastSeen)
	}
	out := duration(since)
	if b.ended == nil && b.status == apiclient.StatusInProgress && b.progress > 0 && b.progress < 100 {
		if ran := b.lastAt.Sub(b.attemptStart); ran > 0 {
			left := time.Duration(float64(ran)*float64(100-b.progress)/float64(b.progress)) - b.now().Sub(b.lastSeen)
			out += "  ETA " + duration(left)
		}
	}
	return out
}
