package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testenv"
)

// bulkStep is one call of a bulk action: the body the CLI must send, and
// the API's answer.
type bulkStep struct {
	body   string
	status int
	answer string
}

// dry is a dry run of filter answered with matched.
func dry(filter string, matched int) bulkStep {
	return bulkStep{body: `{"filter":` + filter + `,"dry_run":true}`, status: 200, answer: fmt.Sprintf(`{"matched":%d}`, matched)}
}

// act is a call of filter with expected, answered with what it did.
func act(filter string, expected int, answer string) bulkStep {
	return bulkStep{body: fmt.Sprintf(`{"filter":%s,"expected":%d}`, filter, expected), status: 200, answer: answer}
}

// bulkAPI answers the calls of a bulk action at path with steps, in
// order, checking the body of each; it returns how many were made.
func bulkAPI(t *testing.T, path string, steps []bulkStep) (*fakeAPI, func() int) {
	t.Helper()
	api := newFakeAPI(t)
	var mu sync.Mutex
	n := 0
	api.mux.HandleFunc("POST "+path, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		if n >= len(steps) {
			t.Errorf("call %d of %s: only %d expected", n+1, path, len(steps))
			w.WriteHeader(http.StatusTeapot)
			return
		}
		step := steps[n]
		n++
		body, _ := io.ReadAll(r.Body)
		if !json.Valid(body) {
			t.Errorf("call %d: not JSON: %s", n, body)
		} else {
			require.JSONEq(t, step.body, string(body), "call %d", n)
		}
		w.Header().Set("Content-Type", "application/json")
		if step.status >= 300 {
			w.Header().Set("Content-Type", "application/problem+json")
		}
		w.WriteHeader(step.status)
		fmt.Fprintf(w, "%s", step.answer)
	})
	return api, func() int {
		mu.Lock()
		defer mu.Unlock()
		return n
	}
}

const demoSleep = `{"type":"demo.sleep"}`

func TestBulkActions(t *testing.T) {
	t.Parallel()
	conflict := bulkStep{body: fmt.Sprintf(`{"filter":%s,"expected":12}`, demoSleep), status: 409,
		answer: `{"title":"Conflict","status":409,"detail":"the filter matches 15 tasks now, more than the 12 expected: count them again and confirm that number","matched":15}`}
	for name, tc := range map[string]struct {
		args     []string
		terminal bool
		stdin    string
		path     string // default /v1/tasks/cancel
		steps    []bulkStep
		code     int
		stdout   string
		stderr   string
	}{
		"confirmed": {
			args:     []string{"cancel", "--all", "-t", "demo.sleep", "-s", "pending", "--created-after", "1h", "--q", "team=billing"},
			terminal: true, stdin: "y\n",
			steps: []bulkStep{
				dry(`{"type":"demo.sleep","status":"PENDING","created_after":"2026-11-23T11:00:00Z","q":"team=billing"}`, 12),
				act(`{"type":"demo.sleep","status":"PENDING","created_after":"2026-11-23T11:00:00Z","q":"team=billing"}`, 12,
					`{"matched":12,"cancelled":12,"skipped":0,"more":false}`)},
			stdout: "cancelled 12, skipped 0\n",
			stderr: `Cancel 12 tasks matching status=PENDING type=demo.sleep created_after=2026-11-23T11:00:00.000Z q="team=billing"? [y/N] `,
		},
		"yes in words": {
			args: []string{"cancel", "--all", "-t", "demo.sleep"}, terminal: true, stdin: " Yes \n",
			steps:  []bulkStep{dry(demoSleep, 1), act(demoSleep, 1, `{"matched":1,"cancelled":0,"skipped":1,"more":false}`)},
			stdout: "cancelled 0, skipped 1\n",
			stderr: "Cancel 1 task matching type=demo.sleep? [y/N] ",
		},
		"declined": {
			args: []string{"cancel", "--all", "-t", "demo.sleep"}, terminal: true, stdin: "n\n",
			steps: []bulkStep{dry(demoSleep, 12)},
			code:  1,
			stderr: "Cancel 12 tasks matching type=demo.sleep? [y/N] " +
				"conveyor: not confirmed: 12 tasks left as they are\n",
		},
		"no answer": {
			args: []string{"cancel", "--all", "-t", "demo.sleep"}, terminal: true, stdin: "",
			steps: []bulkStep{dry(demoSleep, 12)},
			code:  1,
			stderr: "Cancel 12 tasks matching type=demo.sleep? [y/N] \n" +
				"conveyor: not confirmed: 12 tasks left as they are\n",
		},
		"--yes off a terminal": {
			args:   []string{"cancel", "--all", "-t", "demo.sleep", "--yes"},
			steps:  []bulkStep{dry(demoSleep, 12), act(demoSleep, 12, `{"matched":12,"cancelled":12,"skipped":0,"more":false}`)},
			stdout: "cancelled 12, skipped 0\n",
		},
		"not a terminal": {
			args: []string{"cancel", "--all", "-t", "demo.sleep"}, stdin: "y\n",
			code: 2,
			stderr: "conveyor: cancel --all asks for a confirmation, and standard input is not a terminal: give --yes to cancel without asking (--dry-run counts)\n" +
				"Run 'conveyor cancel --help' for usage.\n",
		},
		"nothing matches": {
			args: []string{"cancel", "--all", "-t", "demo.sleep"}, terminal: true,
			steps:  []bulkStep{dry(demoSleep, 0)},
			stdout: "cancelled 0, skipped 0\n",
		},
		"dry run": {
			args:   []string{"cancel", "--all", "-t", "demo.sleep", "--dry-run"},
			steps:  []bulkStep{dry(demoSleep, 12)},
			stdout: "12\n",
		},
		"dry run as JSON": {
			args:   []string{"cancel", "--all", "-t", "demo.sleep", "--dry-run", "-o", "json"},
			steps:  []bulkStep{dry(demoSleep, 12)},
			stdout: "{\"matched\":12}\n",
		},
		// More match when the action comes than were confirmed: the API
		// changes nothing, and says so.
		"conflict": {
			args: []string{"cancel", "--all", "-t", "demo.sleep"}, terminal: true, stdin: "y\n",
			steps: []bulkStep{dry(demoSleep, 12), conflict},
			code:  1,
			stderr: "Cancel 12 tasks matching type=demo.sleep? [y/N] " +
				"conveyor: the filter matches 15 tasks now, more than the 12 expected: count them again and confirm that number (HTTP 409)\n",
		},
		// 2500 tasks, 1000 a call: the second call is within the 2500
		// confirmed; 20 more came before the third, which is asked again.
		"more, asked again beyond the confirmation": {
			args: []string{"cancel", "--all", "-t", "demo.sleep"}, terminal: true, stdin: "y\nyes\n",
			steps: []bulkStep{
				dry(demoSleep, 2500),
				act(demoSleep, 2500, `{"matched":2500,"cancelled":1000,"skipped":0,"more":true}`),
				dry(demoSleep, 1500),
				act(demoSleep, 1500, `{"matched":1500,"cancelled":998,"skipped":2,"more":true}`),
				dry(demoSleep, 522),
				act(demoSleep, 522, `{"matched":522,"cancelled":522,"skipped":0,"more":false}`)},
			stdout: "cancelled 2520, skipped 2\n",
			stderr: "Cancel 2500 tasks matching type=demo.sleep? [y/N] Cancel 522 more tasks matching type=demo.sleep? [y/N] ",
		},
		"more, declined the second time": {
			args: []string{"cancel", "--all", "-t", "demo.sleep"}, terminal: true, stdin: "y\nn\n",
			steps: []bulkStep{
				dry(demoSleep, 1200),
				act(demoSleep, 1200, `{"matched":1200,"cancelled":1000,"skipped":0,"more":true}`),
				dry(demoSleep, 250)},
			code:   1,
			stdout: "cancelled 1000, skipped 0\n",
			stderr: "Cancel 1200 tasks matching type=demo.sleep? [y/N] Cancel 250 more tasks matching type=demo.sleep? [y/N] " +
				"conveyor: not confirmed: 250 tasks left as they are\n",
		},
		"more with --yes": {
			args: []string{"cancel", "--all", "-t", "demo.sleep", "-y"},
			steps: []bulkStep{
				dry(demoSleep, 1200),
				act(demoSleep, 1200, `{"matched":1200,"cancelled":1000,"skipped":0,"more":true}`),
				dry(demoSleep, 250),
				act(demoSleep, 250, `{"matched":250,"cancelled":250,"skipped":0,"more":false}`)},
			stdout: "cancelled 1250, skipped 0\n",
		},
		// What was done is said even when a later call is refused.
		"conflict on a later call": {
			args: []string{"cancel", "--all", "-t", "demo.sleep", "--yes"},
			steps: []bulkStep{
				dry(demoSleep, 1100),
				act(demoSleep, 1100, `{"matched":1100,"cancelled":1000,"skipped":0,"more":true}`),
				dry(demoSleep, 12),
				conflict},
			code:   1,
			stdout: "cancelled 1000, skipped 0\n",
			stderr: "conveyor: the filter matches 15 tasks now, more than the 12 expected: count them again and confirm that number (HTTP 409)\n",
		},
		"no progress": {
			args: []string{"cancel", "--all", "-t", "demo.sleep", "--yes"},
			steps: []bulkStep{
				dry(demoSleep, 1100),
				act(demoSleep, 1100, `{"matched":1100,"cancelled":0,"skipped":1000,"more":true}`)},
			code:   1,
			stdout: "cancelled 0, skipped 1000\n",
			stderr: "conveyor: 1100 tasks still match, but the last call could cancel none of them: run the command again\n",
		},
		"every answer as JSON": {
			args: []string{"cancel", "--all", "-t", "demo.sleep", "--yes", "-o", "json"},
			steps: []bulkStep{
				dry(demoSleep, 1001),
				act(demoSleep, 1001, `{"matched":1001,"cancelled":1000,"skipped":0,"more":true}`),
				dry(demoSleep, 1),
				act(demoSleep, 1, `{"matched":1,"cancelled":1,"skipped":0,"more":false}`)},
			stdout: `{"matched":1001}
{"matched":1001,"cancelled":1000,"skipped":0,"more":true}
{"matched":1}
{"matched":1,"cancelled":1,"skipped":0,"more":false}
`,
		},
		"retry without a filter": {
			args: []string{"retry", "--all"}, terminal: true, stdin: "y\n", path: "/v1/tasks/retry",
			steps:  []bulkStep{dry(`{}`, 3), act(`{}`, 3, `{"matched":3,"retried":3,"skipped":0,"more":false}`)},
			stdout: "retried 3, skipped 0\n",
			stderr: "Retry all 3 FAILED or CANCELLED tasks? [y/N] ",
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			path := tc.path
			if path == "" {
				path = "/v1/tasks/cancel"
			}
			api, calls := bulkAPI(t, path, tc.steps)
			c := newCLI(t, api)
			c.terminal, c.stdin = tc.terminal, strings.NewReader(tc.stdin)
			r := c.run(tc.args...)
			require.Equal(t, tc.stderr, r.stderr)
			require.Equal(t, tc.stdout, r.stdout)
			require.Equal(t, tc.code, r.code)
			require.Equal(t, len(tc.steps), calls(), "every call made, none more")
		})
	}
}

// An interrupt while the question waits for its answer ends the command
// (exit 130) without changing anything.
func TestBulkQuestionInterrupted(t *testing.T) {
	t.Parallel()
	api, calls := bulkAPI(t, "/v1/tasks/retry", []bulkStep{dry(demoSleep, 4)})
	c := newCLI(t, api)
	stdin, typing := io.Pipe()
	t.Cleanup(func() { _ = typing.Close() })
	waiting := &firstRead{r: stdin, reading: make(chan struct{})}
	c.terminal, c.stdin = true, waiting

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan result)
	go func() { done <- c.runContext(ctx, &testenv.SyncBuffer{}, "retry", "--all", "-t", "demo.sleep") }()
	select {
	case <-waiting.reading:
	case <-time.After(10 * time.Second):
		t.Fatal("the question was not asked")
	}
	cancel()
	r := <-done
	require.Equal(t, 130, r.code)
	require.Equal(t, "Retry 4 tasks matching type=demo.sleep? [y/N] \n", r.stderr)
	require.Empty(t, r.stdout)
	require.Equal(t, 1, calls(), "the dry run only")
}

// firstRead closes reading when the first read begins.
type firstRead struct {
	r       io.Reader
	once    sync.Once
	reading chan struct{}
}

func (f *firstRead) Read(p []byte) (int, error) {
	f.once.Do(func() { close(f.reading) })
	return f.r.Read(p)
}
