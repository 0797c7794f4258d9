package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/creack/pty"
	"github.com/hinshun/vt10x"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testenv"
)

// These tests run `conveyor watch` on a pseudo-terminal of 120×20 and read
// what a person would see: the pty's output goes through a terminal
// emulator (vt10x), whose screen is read while the command runs and after
// it ended.

// terminal is a command running on a pseudo-terminal, and the screens it
// showed.
type terminal struct {
	vt   vt10x.Terminal
	done chan struct{}
	code int
	// ptmx is the pty's master side: what is written to it is typed.
	ptmx *os.File

	mu      sync.Mutex
	screens []string // each distinct screen seen, in order
}

const termCols, termRows = 120, 20

func (p *pipeline) onTerminal(t *testing.T, args ...string) *terminal {
	t.Helper()
	cmd := exec.Command(p.bin, args...)
	cmd.Env = p.env("TERM=xterm-256color")
	ptmx, err := pty.StartWithSize(cmd, &pty.Winsize{Rows: termRows, Cols: termCols})
	require.NoError(t, err)
	term := &terminal{vt: vt10x.New(vt10x.WithSize(termCols, termRows)), done: make(chan struct{}), ptmx: ptmx}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-term.done
	})

	copied := make(chan struct{})
	go func() {
		// Ends with EIO once the command has exited and the pty drained.
		_, _ = io.Copy(term.vt, ptmx)
		close(copied)
	}()
	go func() {
		defer close(term.done)
		err := cmd.Wait()
		term.code = 0
		if exit, ok := errors.AsType[*exec.ExitError](err); ok {
			term.code = exit.ExitCode()
		}
		select {
		case <-copied:
		case <-time.After(5 * time.Second):
		}
		_ = ptmx.Close()
		term.snapshot()
	}()
	go func() {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-term.done:
				return
			case <-tick.C:
				term.snapshot()
			}
		}
	}()
	return term
}

func (term *terminal) snapshot() {
	s := term.vt.String()
	term.mu.Lock()
	defer term.mu.Unlock()
	if n := len(term.screens); n == 0 || term.screens[n-1] != s {
		term.screens = append(term.screens, s)
	}
}

// wait waits for the command's end and returns its exit code and last
// screen.
func (term *terminal) wait(t *testing.T) (int, string) {
	t.Helper()
	select {
	case <-term.done:
	case <-time.After(time.Minute):
		t.Fatalf("still running after a minute; screen:\n%s", term.vt.String())
	}
	term.mu.Lock()
	defer term.mu.Unlock()
	return term.code, term.screens[len(term.screens)-1]
}

func (term *terminal) seen() []string {
	term.mu.Lock()
	defer term.mu.Unlock()
	return append([]string(nil), term.screens...)
}

// barLine is the line of a task's bar on the screen.
func barLine(screen, id string) string {
	for line := range strings.Lines(screen) {
		if strings.HasPrefix(line, id) && strings.Contains(line, "[") {
			return strings.TrimRight(line, " \n")
		}
	}
	return ""
}

var percent = regexp.MustCompile(`\] +(\d+)%`)

// A task that completes: its bar rises through intermediate percentages,
// and the final screen shows it full, at 100%, COMPLETED; exit 0. A task
// that fails its only attempt: FAILED with its error; exit 1.
func TestWatchOnATerminal(t *testing.T) {
	p := startPipeline(t)

	// Long enough to be seen running however late the watch starts on a
	// busy machine.
	ok := p.submit(t, "demo.sleep", "-p", `{"steps":25,"step_ms":400}`)
	failing := p.submit(t, "demo.sleep", "-p", `{"steps":2,"step_ms":100,"fail_times":1}`, "--max-attempts", "1")
	watchOK := p.onTerminal(t, "watch", ok)
	watchFailing := p.onTerminal(t, "watch", failing)

	code, screen := watchOK.wait(t)
	t.Logf("final screen:\n%s", screen)
	require.Equal(t, 0, code, screen)
	line := barLine(screen, ok)
	require.Regexp(t, `^`+ok+` demo.sleep +\[=+\] 100%  \S+  COMPLETED$`, line)

	intermediate := map[string]bool{}
	for _, s := range watchOK.seen() {
		if m := percent.FindStringSubmatch(barLine(s, ok)); m != nil && m[1] != "0" && m[1] != "100" {
			intermediate[m[1]+"%"] = true
			require.Regexp(t, `^`+ok+` demo.sleep +\[=*>?-*\] +\d+%  \S+  ETA \S+  Step \d+/25$`, barLine(s, ok), "a bar while it runs")
		}
	}
	require.NotEmpty(t, intermediate, "the bar was seen between 0 and 100%%; screens:\n%s", strings.Join(watchOK.seen(), "\n---\n"))
	t.Logf("seen at %v", intermediate)

	code, screen = watchFailing.wait(t)
	t.Logf("final screen:\n%s", screen)
	require.Equal(t, 1, code, screen)
	require.Regexp(t, `^`+failing+` demo.sleep +\[-+\] +\d+%  \S+  FAILED: .*demo.sleep: fail`, barLine(screen, failing))
	require.Regexp(t, `(?m)^`+failing+` FAILED: .*demo.sleep: failing attempt 1 of the first 1, as asked\s*$`, screen,
		"the whole error, below the bars")
}

// Ctrl-C while watch draws its bars: the terminal echoes "^C" where the
// cursor stands, below the bars, and the command then draws its last
// frame over the bars, each task marked interrupted, and exits 130. That
// frame must start in the first column, as every other frame does: drawn
// two columns to the right, after the echo, its lines (as wide as the
// terminal) wrap and overwrite each other, and the task ids on the screen
// are wrong ("0101a2…" for "01a2…").
func TestWatchInterruptedOnATerminal(t *testing.T) {
	t.Parallel()
	ids := []string{"0193a2b4-0000-7000-8000-0000000000c1", "0193a2b4-0000-7000-8000-0000000000c2"}
	api := newFakeAPI(t)
	for _, id := range ids {
		api.mux.HandleFunc("GET /v1/tasks/"+id+"/stream", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprintf(w, "retry: 2000\n\n")
			for i, e := range []string{streamEvent(1, id, "PENDING", "Queued", 0, ""),
				streamEvent(2, id, "IN_PROGRESS", "Step 3/10", 30, "")} {
				fmt.Fprintf(w, "id: %d\nevent: task\ndata: %s\n\n", i+1, e)
			}
			w.(http.Flusher).Flush()
			<-r.Context().Done() // a task that runs on until the watch stops
		})
	}
	p := &pipeline{url: api.srv.URL, token: "cvk_test", bin: testenv.Binary(t, "./cmd/conveyor"), home: t.TempDir()}
	term := p.onTerminal(t, append([]string{"watch"}, ids...)...)

	testenv.Eventually(t, 30*time.Second, func() error {
		for _, id := range ids {
			if !strings.Contains(barLine(term.vt.String(), id), "Step 3/10") {
				return fmt.Errorf("no running bar of %s yet; screen:\n%s", id, term.vt.String())
			}
		}
		return nil
	})
	_, err := term.ptmx.Write([]byte{3}) // Ctrl-C
	require.NoError(t, err)

	code, screen := term.wait(t)
	t.Logf("final screen:\n%s", screen)
	require.Equal(t, 130, code, screen)
	for _, id := range ids {
		require.Regexp(t, `^`+id+` demo.sleep +\[=+>?-+\] +30%  \S+  interrupted$`, barLine(screen, id),
			"the last frame's bar, from the first column")
		require.Equal(t, 1, strings.Count(screen, id), "each task once on the screen")
	}
}

// More tasks than the terminal has lines: bars for all of them cannot be
// redrawn in place (mpb draws only as many as fit, the first tasks'
// never), so watch prints lines, and every task is seen to its end.
func TestWatchMoreTasksThanTheTerminalHasLines(t *testing.T) {
	t.Parallel()
	ptmx, tty, err := pty.Open()
	require.NoError(t, err)
	t.Cleanup(func() { _ = ptmx.Close() })
	const cols, rows = 120, 8
	require.NoError(t, pty.Setsize(ptmx, &pty.Winsize{Rows: rows, Cols: cols}))
	drained := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, ptmx)
		close(drained)
	}()

	api := newFakeAPI(t)
	var ids []string
	for i := range 12 {
		id := fmt.Sprintf("0193a2b4-0000-7000-8000-0000000000%02d", i)
		ids = append(ids, id)
		api.stream(id, streamEvent(1, id, "IN_PROGRESS", "Step 1/2", 50, ""), streamEvent(2, id, "COMPLETED", "Completed", 100, ""))
	}
	c := newCLI(t, api)
	c.env["TERM"] = "xterm-256color"
	out := &teeFile{File: tty}
	r := c.runContext(context.Background(), out, append([]string{"watch"}, ids...)...)
	require.Equal(t, 0, r.code, r.stderr)
	_ = tty.Close()
	<-drained
	for _, id := range ids {
		require.Regexp(t, `(?m)^\S+  `+id+`  COMPLETED +100%  Completed\r?$`, out.b.String(), "every task is seen to its end")
	}
}

// A task type as long as the terminal is narrow: its label is cut, so
// that the bar and the progress still show.
func TestWatchLongTypeOnANarrowTerminal(t *testing.T) {
	t.Parallel()
	ptmx, tty, err := pty.Open()
	require.NoError(t, err)
	t.Cleanup(func() { _ = ptmx.Close() })
	const cols, rows = 60, 10
	require.NoError(t, pty.Setsize(ptmx, &pty.Winsize{Rows: rows, Cols: cols}))
	vt := vt10x.New(vt10x.WithSize(cols, rows))
	drained := make(chan struct{})
	go func() {
		_, _ = io.Copy(vt, ptmx)
		close(drained)
	}()

	const id, typ = "0193a2b4-0000-7000-8000-0000000000a1", "reports.monthly.generate-invoices-for-all-customers"
	long := func(e string) string { return strings.Replace(e, `"demo.sleep"`, `"`+typ+`"`, 1) }
	api := newFakeAPI(t)
	api.stream(id, long(streamEvent(1, id, "IN_PROGRESS", "Step 1/2", 50, "")), long(streamEvent(2, id, "COMPLETED", "Completed", 100, "")))
	c := newCLI(t, api)
	c.env["TERM"] = "xterm-256color"
	r := c.runContext(context.Background(), &teeFile{File: tty}, "watch", id)
	require.Equal(t, 0, r.code, r.stderr)
	_ = tty.Close()
	<-drained
	screen := vt.String()
	t.Logf("screen:\n%s", screen)
	require.Regexp(t, `(?m)^…000000a1 reports\.\S*… +\[=+\] 100%`, screen, "the label cut, the bar and the progress whole")
}
