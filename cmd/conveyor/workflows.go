package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/mattn/go-runewidth"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

func (a *app) workflowsCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "workflows",
		Aliases: []string{"workflow", "wf"},
		Short:   "List the org's workflows; show one's graph",
		Long: `List the org's workflows, DAGs of jobs that conveyor apply declares in the
jobs file (under workflows:): their number of nodes, what a run does when
a node fails (stop or continue), whether unchanged nodes are memoized,
their schedule and time zone ("-" for a workflow that runs only when
started) and when the schedule next starts a run.

conveyor runs start WORKFLOW starts a run.`,
		Example: `  conveyor workflows
  conveyor workflows get nightly-etl
  conveyor runs start nightly-etl --wait`,
		Args: noArgs,
		RunE: a.listWorkflows,
	}
	cmd.AddCommand(&cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the org's workflows",
		Args:    noArgs,
		RunE:    a.listWorkflows,
	}, a.workflowGetCommand())
	return cmd
}

func (a *app) listWorkflows(cmd *cobra.Command, _ []string) error {
	c, err := a.api(cmd)
	if err != nil {
		return err
	}
	l, err := c.Workflows(cmd.Context())
	if err != nil {
		return err
	}
	if a.output == outputJSON {
		return writeJSON(a.stdout, l.JSON())
	}
	now := a.now()
	t := newTable(a.stdout, "NAME", "NODES", "ON-FAILURE", "MEMOIZE", "SCHEDULE", "NEXT")
	for _, w := range l.Workflows {
		t.row(w.Name, strconv.Itoa(len(w.Nodes)), w.OnFailure, yesNo(w.Memoize), workflowSchedule(w), workflowNext(now, w))
	}
	return t.flush()
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// workflowSchedule is a workflow's schedule and time zone, "-" when it
// runs only when started.
func workflowSchedule(w apiclient.Workflow) string {
	if w.Source == nil {
		return "-"
	}
	return w.Source.Schedule + " " + w.Source.Timezone
}

// workflowNext is when a workflow's schedule next starts a run, from now:
// "in 12s", or why it does not.
func workflowNext(now time.Time, w apiclient.Workflow) string {
	switch {
	case !w.Active:
		return "inactive"
	case w.NextTickAt == nil:
		return "-"
	case !w.NextTickAt.After(now):
		return "due"
	}
	return "in " + age(w.NextTickAt.Sub(now))
}

func (a *app) workflowGetCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "get NAME",
		Short: "Show a workflow and its graph",
		Long: `Show a workflow, then its nodes in topological order, each indented by its
depth in the graph, with its job, the nodes it runs after, and the
datasets it reads and writes.`,
		Args: exactArgs(1, "NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			w, err := c.Workflow(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, w.JSON())
			}
			return a.writeWorkflow(w)
		},
	}
}

// writeWorkflow writes a workflow as "key: value" lines, then its nodes.
func (a *app) writeWorkflow(w apiclient.Workflow) error {
	state := "active"
	if !w.Active {
		state = "inactive"
	}
	var missed, next string
	if w.Source != nil {
		missed = w.Source.Missed
	}
	if w.NextTickAt != nil {
		next = stamp(*w.NextTickAt) + " (" + workflowNext(a.now(), w) + ")"
	}
	if err := fields(a.stdout,
		"name", w.Name,
		"id", w.ID,
		"state", state,
		"on failure", w.OnFailure,
		"memoize", yesNo(w.Memoize),
		"schedule", workflowSchedule(w),
		"missed ticks", missed,
		"next", next,
		"config hash", w.ConfigHash,
		"created", stamp(w.CreatedAt),
		"updated", stamp(w.UpdatedAt),
	); err != nil {
		return err
	}
	if _, err := fmt.Fprintln(a.stdout); err != nil {
		return err
	}
	deps := make([][]string, len(w.Nodes))
	names := make([]string, len(w.Nodes))
	for i, n := range w.Nodes {
		names[i], deps[i] = n.Name, n.DependsOn
	}
	depth := graphDepths(names, deps)
	t := newTable(a.stdout, "NODE", "JOB", "AFTER", "READS", "WRITES")
	for i, n := range w.Nodes {
		t.row(strings.Repeat("  ", depth[i])+n.Name, n.Job, strings.Join(n.DependsOn, ", "),
			strings.Join(n.InputDatasets, ", "), strings.Join(n.OutputDatasets, ", "))
	}
	return t.flush()
}

// graphDepths is the depth of each node of a graph: 0 for a node without
// parents, else 1 + the largest depth of its parents. A parent that is not
// a node is left out, and so is the edge that closes a cycle.
func graphDepths(names []string, parents [][]string) []int {
	index := make(map[string]int, len(names))
	for i, n := range names {
		index[n] = i
	}
	const unknown, visiting = -1, -2
	depth := make([]int, len(names))
	for i := range depth {
		depth[i] = unknown
	}
	var visit func(i int) int
	visit = func(i int) int {
		switch depth[i] {
		case visiting:
			return -1 // a cycle: not counted
		case unknown:
		default:
			return depth[i]
		}
		depth[i] = visiting
		d := 0
		for _, p := range parents[i] {
			if j, ok := index[p]; ok {
				d = max(d, visit(j)+1)
			}
		}
		depth[i] = d
		return d
	}
	for i := range names {
		visit(i)
	}
	return depth
}

func (a *app) runsCommand() *cobra.Command {
	var list runListFlags
	cmd := &cobra.Command{
		Use:   "runs",
		Short: "List workflow runs; start, show, cancel or retry one",
		Long: `List the runs of the org's workflows, newest first, a page at a time: their
status, age and duration. --workflow keeps one workflow's. When there are
more, the command for the next page is printed on standard error.

conveyor runs get ID draws a run's graph, one line per node.`,
		Example: `  conveyor runs --workflow nightly-etl
  conveyor runs start nightly-etl --params '{"day":"2026-11-23"}' --wait
  conveyor runs get 0193a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b
  conveyor runs retry 0193a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b --wait`,
		Args: noArgs,
		RunE: a.listRuns(&list),
	}
	list.register(cmd)
	var ls runListFlags
	lsCmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List workflow runs, newest first",
		Args:    noArgs,
		RunE:    a.listRuns(&ls),
	}
	ls.register(lsCmd)
	cmd.AddCommand(lsCmd, a.runStartCommand(), a.runGetCommand(), a.runCancelCommand(), a.runRetryCommand())
	return cmd
}

// runListFlags are the flags of runs and runs ls.
type runListFlags struct {
	workflow, after string
	limit           int
}

func (f *runListFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringVar(&f.workflow, "workflow", "", "only this workflow's runs")
	fl.IntVarP(&f.limit, "limit", "n", 0, "runs per page, 1 to 200 (default: the API's, 50)")
	fl.StringVar(&f.after, "after", "", "start after this run, printed with the previous page")
}

func (a *app) listRuns(f *runListFlags) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, _ []string) error {
		if err := limitFlag(cmd, f.limit, 200); err != nil {
			return err
		}
		c, err := a.api(cmd)
		if err != nil {
			return err
		}
		l, err := c.Runs(cmd.Context(), f.workflow, f.after, f.limit)
		if err != nil {
			return err
		}
		if a.output == outputJSON {
			return writeJSON(a.stdout, l.JSON())
		}
		now := a.now()
		t := newTable(a.stdout, "ID", "WORKFLOW", "STATUS", "AGE", "DURATION", "ERROR")
		for _, r := range l.Runs {
			t.row(r.ID, r.Workflow, r.Status, ago(now, r.CreatedAt), runDuration(now, r), truncate(r.Error, 60))
		}
		if err := t.flush(); err != nil {
			return err
		}
		if l.NextAfter != "" {
			words := []string{cmd.CommandPath()}
			if f.workflow != "" {
				words = append(words, "--workflow", shellWord(f.workflow))
			}
			if f.limit > 0 {
				words = append(words, "--limit", strconv.Itoa(f.limit))
			}
			words = append(words, "--after", shellWord(l.NextAfter))
			fmt.Fprintf(a.stderr, "more: %s\n", strings.Join(words, " "))
		}
		return nil
	}
}

// runDuration is how long a run took, or has been running.
func runDuration(now time.Time, r apiclient.Run) string {
	if r.FinishedAt != nil {
		return duration(r.FinishedAt.Sub(r.CreatedAt))
	}
	return duration(now.Sub(r.CreatedAt))
}

// runFollowFlags are the flags of the commands that can follow a run to
// its end.
type runFollowFlags struct {
	wait     bool
	interval time.Duration
}

func (f *runFollowFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.BoolVarP(&f.wait, "wait", "w", false, "follow the run to its end; exit 0 only if it COMPLETED")
	fl.DurationVar(&f.interval, "interval", time.Second, "how often --wait asks for the run")
}

func (f *runFollowFlags) check(cmd *cobra.Command) error {
	if f.interval <= 0 {
		return usagef("--interval must be positive, got %s", f.interval)
	}
	// Without --wait nothing asks for the run again: an interval given
	// alone would be ignored without a word.
	if cmd.Flags().Changed("interval") && !f.wait {
		return usagef("--interval applies only with --wait")
	}
	return nil
}

func (a *app) runStartCommand() *cobra.Command {
	var (
		params string
		force  bool
		follow runFollowFlags
	)
	cmd := &cobra.Command{
		Use:   "start WORKFLOW",
		Short: "Start a run of a workflow and draw it",
		Long: `Start a run of WORKFLOW with the params --params gives (a JSON object; {}
when left out), and draw its graph. In a workflow that memoizes, a node
whose job, params, parents' results and input datasets are those of a node
an earlier run completed takes that node's result instead of running;
--force runs every node.

With --wait, the run is then followed to its end: on a terminal, its graph
is redrawn in place; otherwise each change of a node is a line, and the
final graph follows; with -o json, the run is a JSON line each time it
changes. The exit status is then 0 only if the run COMPLETED.`,
		Example: `  conveyor runs start nightly-etl
  conveyor runs start nightly-etl --params '{"day":"2026-11-23"}' --force --wait`,
		Args: exactArgs(1, "WORKFLOW"),
		RunE: func(cmd *cobra.Command, args []string) error {
			var p json.RawMessage
			if cmd.Flags().Changed("params") {
				var err error
				if p, err = jsonObject("--params", []byte(params)); err != nil {
					return err
				}
			}
			if err := follow.check(cmd); err != nil {
				return err
			}
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			r, err := c.StartRun(cmd.Context(), args[0], p, force)
			if err != nil {
				return err
			}
			return a.showRun(cmd.Context(), c, r, follow)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&params, "params", "p", "", "the run's params, a JSON object")
	f.BoolVar(&force, "force", false, "run every node, even those an earlier run memoized")
	follow.register(cmd)
	return cmd
}

func (a *app) runGetCommand() *cobra.Command {
	var follow runFollowFlags
	cmd := &cobra.Command{
		Use:   "get ID",
		Short: "Draw a run's graph: each node, its status and its task",
		Long: `Draw a run's graph: one line per node, in topological order, indented by
its depth, with its status (✓ completed, ✗ failed, ● running, ○ pending or
waiting, ↺ memoized, – skipped or cancelled), its progress while it runs,
its job, the nodes it runs after and its task; then the run's status and
how many nodes stand where. With --wait, the run is followed to its end,
as runs start --wait does.`,
		Args: exactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := follow.check(cmd); err != nil {
				return err
			}
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			r, err := c.Run(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			return a.showRun(cmd.Context(), c, r, follow)
		},
	}
	follow.register(cmd)
	return cmd
}

func (a *app) runCancelCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "cancel ID",
		Short: "Cancel a RUNNING run",
		Long: `Cancel a RUNNING run: its nodes not yet submitted are skipped, its pending
tasks cancelled, and its running ones asked to stop. A FAILED run whose tasks
are still in flight has them stopped the same way (it stays FAILED), so that
it can be retried once they have ended.`,
		Args: exactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			r, err := c.CancelRun(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, r.JSON())
			}
			_, err = fmt.Fprintf(a.stdout, "run %s %s: %s\n", r.ID, r.Status, nodeCounts(r))
			return err
		},
	}
}

func (a *app) runRetryCommand() *cobra.Command {
	var follow runFollowFlags
	cmd := &cobra.Command{
		Use:   "retry ID",
		Short: "Resume a FAILED or CANCELLED run",
		Long: `Resume a FAILED or CANCELLED run: its nodes that did not complete run
again; those that did keep their results, unless another run has written one
of their output datasets since (they run again first). With --wait, the run is then
followed to its end, as runs start --wait does.`,
		Args: exactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := follow.check(cmd); err != nil {
				return err
			}
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			r, err := c.RetryRun(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if !follow.wait {
				if a.output == outputJSON {
					return writeJSON(a.stdout, r.JSON())
				}
				_, err = fmt.Fprintf(a.stdout, "run %s %s: %s\n", r.ID, r.Status, nodeCounts(r))
				return err
			}
			return a.showRun(cmd.Context(), c, r, follow)
		},
	}
	follow.register(cmd)
	return cmd
}

// showRun shows a run: its document, or its graph; when asked, it then
// follows the run to its end.
func (a *app) showRun(ctx context.Context, c *apiclient.Client, r apiclient.Run, follow runFollowFlags) error {
	if !follow.wait {
		if a.output == outputJSON {
			return writeJSON(a.stdout, r.JSON())
		}
		_, err := io.WriteString(a.stdout, drawRun(r, a.now(), runStyle{color: a.colorful()}))
		return err
	}
	return a.followRun(ctx, c, r, follow.interval)
}

// colorful reports whether the output may have colors: text on a terminal
// that can show them, unless NO_COLOR is set.
func (a *app) colorful() bool {
	return a.output == outputText && a.live() && a.getenv("NO_COLOR") == ""
}

// live reports whether stdout is a terminal that can move its cursor, as
// watch decides for its bars.
func (a *app) live() bool {
	return isTerminal(a.stdout) && a.getenv("TERM") != "dumb"
}

// maxPollFailures is how many polls in a row may fail for want of the API
// before following a run gives up.
const maxPollFailures = 5

// followRun shows a run, then asks for it every interval and shows each
// change, until it is no longer RUNNING. It succeeds when the run
// COMPLETED.
func (a *app) followRun(ctx context.Context, c *apiclient.Client, r apiclient.Run, interval time.Duration) error {
	v := a.newRunView(len(r.Nodes))
	if err := v.update(r); err != nil {
		return err
	}
	failures := 0
	timer := time.NewTimer(interval)
	defer timer.Stop()
	for !r.Ended() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-timer.C:
		}
		timer.Reset(interval)
		next, err := c.Run(ctx, r.ID)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if s := apiclient.StatusOf(err); (s == 0 || s == 429 || s >= 500) && failures < maxPollFailures {
				failures++
				continue
			}
			return err
		}
		failures = 0
		r = next
		if err := v.update(r); err != nil {
			return err
		}
	}
	if err := v.end(r); err != nil {
		return err
	}
	if r.Status != apiclient.RunCompleted {
		return &exitStatus{code: exitFailure}
	}
	return nil
}

// runView shows a followed run.
type runView interface {
	// update shows the run as it now is.
	update(r apiclient.Run) error
	// end shows the run once it ended.
	end(r apiclient.Run) error
}

// newRunView is the view for the output: the graph redrawn in place on a
// terminal tall enough, else lines, or JSON lines.
func (a *app) newRunView(nodes int) runView {
	if a.output == outputJSON {
		return &runJSONView{w: a.stdout}
	}
	if a.live() {
		if f, ok := a.stdout.(interface{ Fd() uintptr }); ok {
			cols, rows, err := term.GetSize(int(f.Fd()))
			// The graph is its nodes, a header, a summary, an error and
			// a trace.
			if err == nil && cols > 1 && nodes+4 < rows {
				return &runLiveView{screen: &liveScreen{w: a.stdout}, fd: int(f.Fd()),
					style: runStyle{color: a.getenv("NO_COLOR") == "", width: cols - 1}, now: a.now}
			}
		}
	}
	return &runLineView{w: a.stdout, now: a.now}
}

// runJSONView writes the run as a JSON line each time it changes.
type runJSONView struct {
	w    io.Writer
	last []byte
}

func (v *runJSONView) update(r apiclient.Run) error {
	var buf bytes.Buffer
	if err := json.Compact(&buf, r.JSON()); err != nil {
		return fmt.Errorf("the API's answer is not JSON: %w", err)
	}
	if bytes.Equal(buf.Bytes(), v.last) {
		return nil
	}
	v.last = bytes.Clone(buf.Bytes())
	buf.WriteByte('\n')
	_, err := v.w.Write(buf.Bytes())
	return err
}

func (v *runJSONView) end(apiclient.Run) error { return nil }

// runLiveView redraws the run's graph in place.
type runLiveView struct {
	screen *liveScreen
	style  runStyle
	now    func() time.Time
	// fd is the terminal's, whose width is read again at each frame: a
	// frame wider than a terminal made narrower would wrap, and take more
	// lines than the next one goes back over.
	fd int
}

func (v *runLiveView) update(r apiclient.Run) error {
	if cols, _, err := term.GetSize(v.fd); err == nil && cols > 1 {
		v.style.width = cols - 1
	}
	return v.screen.draw(drawRun(r, v.now(), v.style))
}

func (v *runLiveView) end(r apiclient.Run) error { return v.update(r) }

// liveScreen draws frames over one another: each frame replaces the
// previous one's lines, which must not be wider than the terminal.
type liveScreen struct {
	w io.Writer
	// lines is the number of lines of the last frame drawn.
	lines int
}

func (s *liveScreen) draw(frame string) error {
	var b strings.Builder
	if s.lines > 0 {
		// Back to the start of the previous frame, then clear the screen
		// below it, for a frame shorter than the previous one.
		fmt.Fprintf(&b, "\r\x1b[%dA\x1b[J", s.lines)
	}
	b.WriteString(frame)
	s.lines = strings.Count(frame, "\n")
	_, err := io.WriteString(s.w, b.String())
	return err
}

// runLineView writes the graph, then a line for each change of a node
// (its status, progress or state), then the final graph.
type runLineView struct {
	w    io.Writer
	now  func() time.Time
	last map[string]apiclient.RunNode
	// nameWidth is the width of the longest node name, to align the lines.
	nameWidth int
	// drawn is the run's status in the graph last written, "" when the
	// graph is no longer the last thing written.
	drawn string
}

func (v *runLineView) update(r apiclient.Run) error {
	if v.last == nil {
		v.last = make(map[string]apiclient.RunNode, len(r.Nodes))
		for _, n := range r.Nodes {
			v.last[n.Name] = n
			v.nameWidth = max(v.nameWidth, runewidth.StringWidth(n.Name))
		}
		return v.draw(r)
	}
	var b strings.Builder
	for _, n := range r.Nodes {
		old, seen := v.last[n.Name]
		v.last[n.Name] = n
		if seen && old.Status == n.Status && old.Progress == n.Progress && old.TaskState == n.TaskState {
			continue
		}
		line := fmt.Sprintf("%s  %s  %-11s %3d%%  %s", stamp(v.now()), runewidth.FillRight(n.Name, v.nameWidth),
			n.Status, n.Progress, n.TaskState)
		b.WriteString(strings.TrimRight(oneLine(line), " ") + "\n")
	}
	if b.Len() == 0 {
		return nil
	}
	v.drawn = ""
	_, err := io.WriteString(v.w, b.String())
	return err
}

// end draws the final graph, unless it is already the last thing written.
func (v *runLineView) end(r apiclient.Run) error {
	if v.drawn == r.Status {
		return nil
	}
	return v.draw(r)
}

func (v *runLineView) draw(r apiclient.Run) error {
	v.drawn = r.Status
	_, err := io.WriteString(v.w, drawRun(r, v.now(), runStyle{}))
	return err
}

// runStyle says how to draw a run.
type runStyle struct {
	// color adds the terminal's colors to the statuses.
	color bool
	// width cuts each line to that many columns; 0 leaves them whole.
	width int
}

// SGR sequences of the colors.
const (
	sgrReset  = "\x1b[0m"
	sgrBold   = "\x1b[1m"
	sgrDim    = "\x1b[2m"
	sgrRed    = "\x1b[31m"
	sgrGreen  = "\x1b[32m"
	sgrYellow = "\x1b[33m"
	sgrBlue   = "\x1b[34m"
	sgrCyan   = "\x1b[36m"
)

// nodeLook is how a node's status is drawn: its glyph, its color, and its
// name in the counts.
type nodeLook struct{ glyph, sgr, label string }

// nodeLooks are the statuses, in the order of the counts.
var nodeLooks = []struct {
	status string
	nodeLook
}{
	{apiclient.StatusCompleted, nodeLook{"✓", sgrGreen, "completed"}},
	{apiclient.NodeMemoized, nodeLook{"↺", sgrCyan, "memoized"}},
	{apiclient.StatusInProgress, nodeLook{"●", sgrBlue + sgrBold, "running"}},
	{apiclient.StatusPending, nodeLook{"○", "", "pending"}},
	{apiclient.NodeSubmitted, nodeLook{"○", "", "submitted"}},
	{apiclient.NodeWaiting, nodeLook{"○", sgrDim, "waiting"}},
	{apiclient.StatusFailed, nodeLook{"✗", sgrRed + sgrBold, "failed"}},
	{apiclient.StatusCancelled, nodeLook{"–", sgrYellow, "cancelled"}},
	{apiclient.NodeSkipped, nodeLook{"–", sgrDim, "skipped"}},
}

func lookOf(status string) nodeLook {
	for _, l := range nodeLooks {
		if l.status == status {
			return l.nodeLook
		}
	}
	return nodeLook{"?", "", strings.ToLower(status)}
}

// runSGR is the color of a run's status.
func runSGR(status string) string {
	switch status {
	case apiclient.RunCompleted:
		return sgrGreen
	case apiclient.RunFailed:
		return sgrRed + sgrBold
	case apiclient.RunCancelled:
		return sgrYellow
	case apiclient.RunRunning:
		return sgrBlue + sgrBold
	}
	return ""
}

// nodeCounts is how many of a run's nodes stand where: "2 completed, 1
// running, 1 waiting".
func nodeCounts(r apiclient.Run) string {
	counts := map[string]int{}
	var others []string
	for _, n := range r.Nodes {
		if counts[n.Status] == 0 && lookOf(n.Status).glyph == "?" {
			others = append(others, n.Status)
		}
		counts[n.Status]++
	}
	var parts []string
	for _, l := range nodeLooks {
		if n := counts[l.status]; n > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n, l.label))
		}
	}
	for _, s := range others {
		parts = append(parts, fmt.Sprintf("%d %s", counts[s], lookOf(s).label))
	}
	if len(parts) == 0 {
		return "no nodes"
	}
	return strings.Join(parts, ", ")
}

// segment is a piece of a line and its color.
type segment struct{ text, sgr string }

// drawRun draws a run's graph: a header, one line per node in the order
// of the run (topological), indented by its depth, then a summary, the
// run's error and its trace in Jaeger. now measures how long a running run
// has run.
func drawRun(r apiclient.Run, now time.Time, style runStyle) string {
	var out strings.Builder
	line := func(segs ...segment) {
		out.WriteString(renderLine(segs, style))
		out.WriteByte('\n')
	}

	done := 0
	for _, n := range r.Nodes {
		if n.Status == apiclient.StatusCompleted || n.Status == apiclient.NodeMemoized {
			done++
		}
	}
	line(segment{text: "run " + r.ID + "  " + r.Workflow + "  "}, segment{r.Status, runSGR(r.Status)},
		segment{text: fmt.Sprintf("  (%d/%d done)", done, len(r.Nodes))})

	names := make([]string, len(r.Nodes))
	deps := make([][]string, len(r.Nodes))
	for i, n := range r.Nodes {
		names[i], deps[i] = n.Name, n.DependsOn
	}
	depth := graphDepths(names, deps)
	// The columns: the node (indent, glyph, name, progress), its job, its
	// parents, its task.
	cells := make([][4]string, len(r.Nodes))
	var widths [4]int
	for i, n := range r.Nodes {
		c := &cells[i]
		c[0] = strings.Repeat("  ", depth[i]) + lookOf(n.Status).glyph + " " + n.Name
		if n.Status == apiclient.StatusInProgress {
			c[0] += fmt.Sprintf("  %d%%", n.Progress)
		}
		c[1] = "job " + n.Job
		if len(n.DependsOn) > 0 {
			c[2] = "← " + strings.Join(n.DependsOn, ", ")
		}
		if n.TaskID != "" {
			c[3] = "task " + n.TaskID
			if n.MemoizedFrom != "" {
				c[3] += " of run " + n.MemoizedFrom
			}
		}
		for j, s := range c {
			widths[j] = max(widths[j], runewidth.StringWidth(s))
		}
	}
	for i, n := range r.Nodes {
		indent := strings.Repeat("  ", depth[i])
		look := lookOf(n.Status)
		head := look.glyph + " " + n.Name
		var rest strings.Builder
		rest.WriteString(strings.TrimPrefix(cells[i][0], indent+head))
		pad := widths[0] - runewidth.StringWidth(cells[i][0])
		for j := 1; j < 4; j++ {
			if widths[j] == 0 {
				continue
			}
			rest.WriteString(strings.Repeat(" ", pad+2))
			rest.WriteString(cells[i][j])
			pad = widths[j] - runewidth.StringWidth(cells[i][j])
		}
		line(segment{text: indent}, segment{head, look.sgr}, segment{text: strings.TrimRight(rest.String(), " ")})
	}

	took := ""
	switch {
	case r.FinishedAt != nil:
		took = " in " + duration(r.FinishedAt.Sub(r.CreatedAt))
	case !r.Ended():
		took = " for " + duration(now.Sub(r.CreatedAt))
	}
	line(segment{r.Status, runSGR(r.Status)}, segment{text: took + ": " + nodeCounts(r)})
	if r.Error != "" {
		line(segment{"error:", sgrRed}, segment{text: " " + r.Error})
	}
	if r.TraceURL != "" {
		line(segment{text: "trace: " + r.TraceURL})
	}
	return out.String()
}

// renderLine joins a line's segments, cut to style.width columns (ending
// in "…" when cut), with their colors when style.color.
func renderLine(segs []segment, style runStyle) string {
	total := 0
	for i, s := range segs {
		// A node's state or the run's error may hold a newline, which
		// would make the line two, and a live frame taller than it counts.
		segs[i].text = oneLine(s.text)
		total += runewidth.StringWidth(segs[i].text)
	}
	cut := style.width > 0 && total > style.width
	room := style.width - 1 // for the "…"
	var b strings.Builder
	for _, s := range segs {
		text := s.text
		if cut {
			if room <= 0 {
				break
			}
			w := runewidth.StringWidth(text)
			if w > room {
				text = runewidth.Truncate(text, room, "")
				w = runewidth.StringWidth(text)
			}
			room -= w
		}
		if style.color && s.sgr != "" && text != "" {
			text = s.sgr + text + sgrReset
		}
		b.WriteString(text)
	}
	if cut {
		b.WriteString("…")
	}
	return b.String()
}

func (a *app) lineageCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "lineage DATASET",
		Short: "Show which workflow nodes write and read a dataset, and its versions",
		Long: `Show the lineage of a dataset: the workflow nodes that write it (their
output_datasets) and read it (their input_datasets), then its latest
versions, newest first, each the completed task of the node that wrote it.`,
		Example: `  conveyor lineage raw.orders
  conveyor lineage s3://bucket/orders -o json`,
		Args: exactArgs(1, "DATASET"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			l, err := c.Lineage(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, l.JSON())
			}
			return a.writeLineage(l)
		},
	}
}

// writeLineage writes a dataset's producers, consumers and versions.
func (a *app) writeLineage(l apiclient.Lineage) error {
	fmt.Fprintf(a.stdout, "dataset %s\n", l.Dataset)
	refs := func(title string, refs []apiclient.DatasetRef) error {
		fmt.Fprintf(a.stdout, "\n%s:\n", title)
		if len(refs) == 0 {
			_, err := fmt.Fprintln(a.stdout, "  none")
			return err
		}
		t := newTable(a.stdout, "  WORKFLOW", "NODE", "JOB")
		for _, r := range refs {
			t.row("  "+r.Workflow, r.Node, r.Job)
		}
		return t.flush()
	}
	if err := refs("written by", l.Producers); err != nil {
		return err
	}
	if err := refs("read by", l.Consumers); err != nil {
		return err
	}
	fmt.Fprintf(a.stdout, "\nlatest versions:\n")
	if len(l.Versions) == 0 {
		_, err := fmt.Fprintln(a.stdout, "  none")
		return err
	}
	now := a.now()
	t := newTable(a.stdout, "  VERSION", "CREATED", "AGE", "RUN", "NODE", "TASK")
	for _, v := range l.Versions {
		t.row("  "+strconv.FormatInt(v.Version, 10), stamp(v.CreatedAt), ago(now, v.CreatedAt), v.RunID, v.Node, v.TaskID)
	}
	return t.flush()
}
