package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/creack/pty"
	"github.com/hinshun/vt10x"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

// diamondRunning is a run of a diamond, a → (b, c) → report: a completed,
// b running, c memoized, report waiting.
const diamondRunning = `{"id":"0193a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b","workflow":"diamond","status":"RUNNING","on_failure":"stop",
	"memoize":true,"force":false,"params":{},"created_at":"2026-11-23T11:59:48Z","updated_at":"2026-11-23T11:59:58Z","nodes":[
	{"name":"a","job":"extract","depends_on":[],"input_datasets":[],"output_datasets":["raw.orders"],"status":"COMPLETED",
	 "state":"SUBMITTED","task_id":"0193a2b4-0000-7000-8000-00000000000a","task_state":"done","progress":100,"attempt":1,"memoized":false},
	{"name":"b","job":"transform","depends_on":["a"],"input_datasets":["raw.orders"],"output_datasets":[],"status":"IN_PROGRESS",
	 "state":"SUBMITTED","task_id":"0193a2b4-0000-7000-8000-00000000000b","task_state":"step 2 of 5","progress":42,"attempt":1,"memoized":false},
	{"name":"c","job":"enrich","depends_on":["a"],"input_datasets":[],"output_datasets":[],"status":"MEMOIZED",
	 "state":"MEMOIZED","task_id":"0193a2b4-0000-7000-8000-0000000000c0","progress":100,"attempt":1,"memoized":true,
	 "memoized_from":"0193a2b4-0000-7000-8000-0000000000f0"},
	{"name":"report","job":"report","depends_on":["b","c"],"input_datasets":[],"output_datasets":[],"status":"WAITING",
	 "state":"WAITING","progress":0,"attempt":0,"memoized":false}]}`

const diamondDrawn = `run 0193a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b  diamond  RUNNING  (2/4 done)
✓ a           job extract            task 0193a2b4-0000-7000-8000-00000000000a
  ● b  42%    job transform  ← a     task 0193a2b4-0000-7000-8000-00000000000b
  ↺ c         job enrich     ← a     task 0193a2b4-0000-7000-8000-0000000000c0 of run 0193a2b4-0000-7000-8000-0000000000f0
    ○ report  job report     ← b, c
RUNNING for 12s: 1 completed, 1 memoized, 1 running, 1 waiting
`

func decodeRun(t *testing.T, doc string) apiclient.Run {
	t.Helper()
	var r apiclient.Run
	require.NoError(t, json.Unmarshal([]byte(doc), &r))
	return r
}

// nodeDoc is a node of a run in a fixture.
func nodeDoc(name, status string, progress int, task string, parents ...string) string {
	deps, _ := json.Marshal(append([]string{}, parents...))
	taskID := ""
	if task != "" {
		taskID = fmt.Sprintf(`"task_id":%q,`, task)
	}
	state := status
	switch status {
	case "PENDING", "IN_PROGRESS", "COMPLETED", "FAILED", "CANCELLED":
		state = "SUBMITTED"
	}
	return fmt.Sprintf(`{"name":%q,"job":%q,"depends_on":%s,"input_datasets":[],"output_datasets":[],"status":%q,"state":%q,%s
		"progress":%d,"attempt":1,"memoized":%t}`, name, name, deps, status, state, taskID, progress, status == "MEMOIZED")
}

// runDoc is a run of the workflow "etl" in a fixture; extra are more fields,
// each ending in a comma.
func runDoc(id, status, extra string, nodes ...string) string {
	return fmt.Sprintf(`{"id":%q,"workflow":"etl","status":%q,"on_failure":"stop","memoize":false,"force":false,"params":{},%s
		"created_at":"2026-11-23T11:59:00Z","updated_at":"2026-11-23T11:59:30Z","nodes":[%s]}`,
		id, status, extra, strings.Join(nodes, ","))
}

// traced is the trace fields of a run whose trace was exported, for runDoc.
const traced = `"trace_id":"4bf92f3577b34da6a3ce929d0e0e4736",
	"trace_url":"http://jaeger.example:16686/trace/4bf92f3577b34da6a3ce929d0e0e4736",`

// The graph: a line per node in topological order, indented by depth,
// with its glyph, progress while running, job, parents and task; then the
// summary, the run's error and its trace in Jaeger.
func TestDrawRun(t *testing.T) {
	t.Parallel()
	r := decodeRun(t, diamondRunning)
	require.Equal(t, diamondDrawn, drawRun(r, testNow, runStyle{}))

	// Ended: how long it took, every kind of node, and the run's error.
	r = decodeRun(t, runDoc("r1", "FAILED", `"error":"node load failed","finished_at":"2026-11-23T11:59:03.2Z",`+traced,
		nodeDoc("extract", "COMPLETED", 100, "t1"),
		nodeDoc("clean", "CANCELLED", 10, "t2", "extract"),
		nodeDoc("load", "FAILED", 30, "t3", "extract"),
		nodeDoc("index", "SKIPPED", 0, "", "load"),
		nodeDoc("audit", "PENDING", 0, "t5"),
		nodeDoc("odd", "SOMETHING_NEW", 0, "", "nowhere", "audit")))
	require.Equal(t, `run r1  etl  FAILED  (1/6 done)
✓ extract    job extract                    task t1
  – clean    job clean    ← extract         task t2
  ✗ load     job load     ← extract         task t3
    – index  job index    ← load
○ audit      job audit                      task t5
  ? odd      job odd      ← nowhere, audit
FAILED in 3.2s: 1 completed, 1 pending, 1 failed, 1 cancelled, 1 skipped, 1 something_new
error: node load failed
trace: http://jaeger.example:16686/trace/4bf92f3577b34da6a3ce929d0e0e4736
`, drawRun(r, testNow, runStyle{}))

	// Without nodes (as listed): the header and the summary.
	r = decodeRun(t, runDoc("r2", "COMPLETED", `"finished_at":"2026-11-23T12:00:00Z",`))
	require.Equal(t, "run r2  etl  COMPLETED  (0/0 done)\nCOMPLETED in 1m00s: no nodes\n", drawRun(r, testNow, runStyle{}))
}

// Colors, on a terminal, go around the glyph and name of each node and
// the run's status, and nothing else; a width cuts every line.
func TestDrawRunColorsAndWidth(t *testing.T) {
	t.Parallel()
	r := decodeRun(t, diamondRunning)
	colored := drawRun(r, testNow, runStyle{color: true})
	require.Contains(t, colored, "diamond  \x1b[34m\x1b[1mRUNNING\x1b[0m  (2/4 done)\n")
	require.Contains(t, colored, "\x1b[32m✓ a\x1b[0m           job extract")
	require.Contains(t, colored, "  \x1b[34m\x1b[1m● b\x1b[0m  42%    job transform")
	require.Contains(t, colored, "  \x1b[36m↺ c\x1b[0m ")
	require.Contains(t, colored, "    \x1b[2m○ report\x1b[0m  job report")
	plain := strings.NewReplacer("\x1b[0m", "", "\x1b[1m", "", "\x1b[2m", "", "\x1b[32m", "", "\x1b[34m", "", "\x1b[36m", "").Replace(colored)
	require.Equal(t, diamondDrawn, plain)

	cut := drawRun(r, testNow, runStyle{width: 24, color: true})
	require.Equal(t, `run 0193a2b4-5c6d-7e8f-…
`+"\x1b[32m✓ a\x1b[0m"+`           job extra…
  `+"\x1b[34m\x1b[1m● b\x1b[0m"+`  42%    job trans…
  `+"\x1b[36m↺ c\x1b[0m"+`         job enric…
    `+"\x1b[2m○ report\x1b[0m"+`  job repor…
`+"\x1b[34m\x1b[1mRUNNING\x1b[0m"+` for 12s: 1 comp…
`, cut)
	// A cut inside a colored segment keeps the color around what is left.
	require.Equal(t, "\x1b[2m○ re\x1b[0m…", renderLine([]segment{{"○ report", sgrDim}, {text: " job"}}, runStyle{width: 5, color: true}))
}

func TestWorkflowGraphDepths(t *testing.T) {
	t.Parallel()
	require.Equal(t, []int{0, 1, 1, 2, 3, 0}, graphDepths(
		[]string{"a", "b", "c", "d", "e", "f"},
		[][]string{nil, {"a"}, {"a"}, {"b", "c"}, {"a", "d"}, {"missing"}}))
	// Out of order, and a cycle (which the API refuses) does not loop.
	require.Equal(t, []int{1, 0}, graphDepths([]string{"b", "a"}, [][]string{{"a"}, nil}))
	require.Equal(t, []int{1, 0}, graphDepths([]string{"x", "y"}, [][]string{{"y"}, {"x"}}))
}

const workflowsJSON = `{"workflows":[
	{"id":"w1","name":"nightly-etl","on_failure":"continue","memoize":true,
	 "source":{"kind":"cron","schedule":"0 2 * * *","timezone":"Europe/Paris","missed":"run_once"},"active":true,
	 "nodes":[{"name":"extract","job":"extract","output_datasets":["raw.orders"]},
	  {"name":"clean","job":"clean","depends_on":["extract"],"input_datasets":["raw.orders"],"output_datasets":["clean.orders"]},
	  {"name":"stats","job":"stats","depends_on":["extract"]},
	  {"name":"load","job":"load","depends_on":["clean","stats"],"input_datasets":["clean.orders"]}],
	 "config_hash":"abc123","next_tick_at":"2026-11-24T01:00:00Z","created_at":"2026-11-23T11:00:00Z","updated_at":"2026-11-23T11:30:00Z"},
	{"id":"w2","name":"adhoc","on_failure":"stop","memoize":false,"active":true,"nodes":[{"name":"a","job":"a"}],
	 "config_hash":"def","created_at":"2026-11-23T11:00:00Z","updated_at":"2026-11-23T11:00:00Z"},
	{"id":"w3","name":"old","on_failure":"stop","memoize":false,
	 "source":{"kind":"cron","schedule":"@daily","timezone":"UTC","missed":"run_once"},"active":false,"nodes":[{"name":"a","job":"a"}],
	 "config_hash":"ghi","created_at":"2026-11-23T11:00:00Z","updated_at":"2026-11-23T11:00:00Z"}]}`

func TestWorkflows(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/workflows", 200, workflowsJSON)
	one := workflowsJSON[strings.Index(workflowsJSON, `{"id":"w1"`):strings.Index(workflowsJSON, `,
	{"id":"w2"`)]
	api.json("GET /v1/workflows/nightly-etl", 200, one)
	api.problem("GET /v1/workflows/nope", 404, "no workflow nope")
	c := newCLI(t, api)

	table := `NAME         NODES  ON-FAILURE  MEMOIZE  SCHEDULE                NEXT
nightly-etl  4      continue    yes      0 2 * * * Europe/Paris  in 13h
adhoc        1      stop        no       -                       -
old          1      stop        no       @daily UTC              inactive
`
	for _, args := range [][]string{{"workflows"}, {"workflows", "ls"}, {"workflows", "list"}} {
		r := c.run(args...)
		require.Equal(t, 0, r.code, r.stderr)
		require.Equal(t, table, r.stdout, "%v", args)
	}
	r := c.run("workflows", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, workflowsJSON, r.stdout)

	r = c.run("workflows", "get", "nightly-etl")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `name:         nightly-etl
id:           w1
state:        active
on failure:   continue
memoize:      yes
schedule:     0 2 * * * Europe/Paris
missed ticks: run_once
next:         2026-11-24T01:00:00.000Z (in 13h)
config hash:  abc123
created:      2026-11-23T11:00:00.000Z
updated:      2026-11-23T11:30:00.000Z

NODE      JOB      AFTER         READS         WRITES
extract   extract                              raw.orders
  clean   clean    extract       raw.orders    clean.orders
  stats   stats    extract
    load  load     clean, stats  clean.orders
`, r.stdout)
	r = c.run("workflows", "get", "nightly-etl", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, one, r.stdout)

	r = c.run("workflows", "get", "nope")
	require.Equal(t, 1, r.code)
	require.Equal(t, "conveyor: no workflow nope (HTTP 404)\n", r.stderr)
	r = c.run("workflows", "get")
	require.Equal(t, 2, r.code)
	require.Equal(t, "conveyor: get wants NAME, got 0 arguments\nRun 'conveyor workflows get --help' for usage.\n", r.stderr)
}

func TestRunsList(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	page := `{"runs":[` + runDoc("r3", "RUNNING", "") + "," +
		runDoc("r2", "FAILED", `"error":"node load failed","finished_at":"2026-11-23T11:59:03.2Z",`) + "," +
		runDoc("r1", "COMPLETED", `"finished_at":"2026-11-23T12:00:05Z",`) + `],"next_after":"r1"}`
	api.json("GET /v1/runs", 200, page)
	api.json("GET /v1/workflows/{name}/runs", 200, `{"runs":[`+runDoc("r3", "RUNNING", "")+`],"next_after":"r3"}`)
	c := newCLI(t, api)

	table := `ID  WORKFLOW  STATUS     AGE  DURATION  ERROR
r3  etl       RUNNING    1m   1m00s
r2  etl       FAILED     1m   3.2s      node load failed
r1  etl       COMPLETED  1m   1m05s
`
	for _, args := range [][]string{{"runs"}, {"runs", "ls", "-n", "3"}, {"runs", "list", "--after", "r9"}} {
		r := c.run(args...)
		require.Equal(t, 0, r.code, r.stderr)
		require.Equal(t, table, r.stdout, "%v", args)
	}
	r := c.run("runs", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, page, r.stdout)
	r = c.run("runs", "ls", "--workflow", "nightly etl", "--limit", "1")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "ID  WORKFLOW  STATUS   AGE  DURATION  ERROR\nr3  etl       RUNNING  1m   1m00s\n", r.stdout)
	// The next page's command, on standard error.
	require.Equal(t, "more: conveyor runs ls --workflow 'nightly etl' --limit 1 --after r3\n", r.stderr)

	var calls []string
	for _, req := range api.recorded() {
		calls = append(calls, req.Method+" "+req.Path+" "+req.Query)
	}
	require.Equal(t, []string{"GET /v1/runs ", "GET /v1/runs limit=3", "GET /v1/runs after=r9", "GET /v1/runs ",
		"GET /v1/workflows/nightly etl/runs limit=1"}, calls)

	r = c.run("runs", "-n", "3")
	require.Equal(t, "more: conveyor runs --limit 3 --after r1\n", r.stderr)
	r = c.run("runs", "ls")
	require.Equal(t, "more: conveyor runs ls --after r1\n", r.stderr)

	r = c.run("runs", "--limit", "500")
	require.Equal(t, 2, r.code)
	require.Equal(t, "conveyor: --limit must be between 1 and 200, got 500\nRun 'conveyor runs --help' for usage.\n", r.stderr)
}

// runSequence answers a run's GET with each of docs in turn, then the last one
// again and again, and counts the GETs.
type runSequence struct {
	mu   sync.Mutex
	docs []string
	gets int
}

func (s *runSequence) handle(api *fakeAPI, id string) {
	api.mux.HandleFunc("GET /v1/runs/"+id, func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		doc := s.docs[min(s.gets, len(s.docs)-1)]
		s.gets++
		s.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, doc)
	})
}

// start sends the params and --force; without --wait it draws the run
// it started.
func TestRunsStart(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("POST /v1/workflows/{name}/runs", 201, diamondRunning)
	api.problem("POST /v1/workflows/nope/runs", 404, "no workflow nope")
	c := newCLI(t, api)

	r := c.run("runs", "start", "diamond")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, diamondDrawn, r.stdout)
	r = c.run("runs", "start", "diamond", "--params", `{"day": "2026-11-23", "n": 1e2}`, "--force", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, diamondRunning, r.stdout)
	reqs := api.recorded()
	require.Equal(t, "/v1/workflows/diamond/runs", reqs[0].Path)
	require.Equal(t, `{}`, reqs[0].Body)
	require.Equal(t, `{"params":{"day":"2026-11-23","n":1e2},"force":true}`, reqs[1].Body, "the params' numbers as written")

	r = c.run("runs", "start", "nope")
	require.Equal(t, 1, r.code)
	require.Equal(t, "conveyor: no workflow nope (HTTP 404)\n", r.stderr)
	for _, tc := range []struct{ args, stderr string }{
		{"diamond -p [1]", "conveyor: --params must be a JSON object, {…}\n"},
		{"diamond -p {", "conveyor: --params is not valid JSON\n"},
		{"diamond --wait --interval 0s", "conveyor: --interval must be positive, got 0s\n"},
		{"diamond --interval=-1s", "conveyor: --interval must be positive, got -1s\n"},
		{"diamond extra", "conveyor: start wants WORKFLOW, got 2 arguments\n"},
	} {
		r := c.run(append([]string{"runs", "start"}, strings.Fields(tc.args)...)...)
		require.Equal(t, 2, r.code, tc.args)
		require.Equal(t, tc.stderr+"Run 'conveyor runs start --help' for usage.\n", r.stderr, tc.args)
	}
	require.Len(t, api.recorded(), 3, "a refused flag sends nothing")
}

// Off a terminal, --wait draws the run, prints a line per change of a
// node, then draws the final run; the exit status is 0 only if the run
// COMPLETED.
func TestRunsStartWait(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("POST /v1/workflows/ok/runs", 201, runDoc("ok1", "RUNNING", "",
		nodeDoc("a", "PENDING", 0, "t1"), nodeDoc("load", "WAITING", 0, "", "a")))
	ok := &runSequence{docs: []string{
		runDoc("ok1", "RUNNING", "", nodeDoc("a", "IN_PROGRESS", 50, "t1"), nodeDoc("load", "WAITING", 0, "", "a")),
		runDoc("ok1", "RUNNING", "", nodeDoc("a", "IN_PROGRESS", 50, "t1"), nodeDoc("load", "WAITING", 0, "", "a")),
		runDoc("ok1", "COMPLETED", `"finished_at":"2026-11-23T11:59:04Z",`,
			nodeDoc("a", "COMPLETED", 100, "t1"), nodeDoc("load", "MEMOIZED", 100, "t0", "a")),
	}}
	ok.handle(api, "ok1")
	api.json("POST /v1/workflows/bad/runs", 201, runDoc("bad1", "RUNNING", "", nodeDoc("a", "IN_PROGRESS", 0, "t1")))
	bad := &runSequence{docs: []string{
		runDoc("bad1", "FAILED", `"error":"node a failed","finished_at":"2026-11-23T11:59:01Z",`, nodeDoc("a", "FAILED", 0, "t1")),
	}}
	bad.handle(api, "bad1")
	c := newCLI(t, api)

	r := c.run("runs", "start", "ok", "--wait", "--interval", "1ms")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `run ok1  etl  RUNNING  (0/2 done)
○ a       job a          task t1
  ○ load  job load  ← a
RUNNING for 1m00s: 1 pending, 1 waiting
2026-11-23T12:00:00.000Z  a     IN_PROGRESS  50%
2026-11-23T12:00:00.000Z  a     COMPLETED   100%
2026-11-23T12:00:00.000Z  load  MEMOIZED    100%
run ok1  etl  COMPLETED  (2/2 done)
✓ a       job a          task t1
  ↺ load  job load  ← a  task t0
COMPLETED in 4s: 1 completed, 1 memoized
`, r.stdout)
	require.Equal(t, 3, ok.gets, "until the run ended")

	r = c.run("runs", "start", "bad", "-w", "--interval", "1ms")
	require.Equal(t, 1, r.code)
	require.Empty(t, r.stderr, "the failure is on the screen")
	require.True(t, strings.HasSuffix(r.stdout, "FAILED in 1s: 1 failed\nerror: node a failed\n"), r.stdout)

	// JSON lines: the run as started, then each time it changed.
	ok.gets = 0
	r = c.run("runs", "start", "ok", "--wait", "--interval", "1ms", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	require.Len(t, lines, 3)
	require.JSONEq(t, ok.docs[0], lines[1])
	require.JSONEq(t, ok.docs[2], lines[2])

	// get --wait follows a run started elsewhere; a run that already ended
	// is shown once.
	r = c.run("runs", "get", "bad1", "--wait")
	require.Equal(t, 1, r.code)
	require.Equal(t, "run bad1  etl  FAILED  (0/1 done)\n✗ a  job a  task t1\nFAILED in 1s: 1 failed\nerror: node a failed\n", r.stdout)
	r = c.run("runs", "get", "bad1")
	require.Equal(t, 0, r.code, "without --wait, showing a failed run succeeds")
}

// A run the API cannot be asked about for a moment is asked again; one it
// refuses ends the wait.
func TestRunsWaitThroughErrors(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("POST /v1/workflows/etl/runs", 201, runDoc("r1", "RUNNING", "", nodeDoc("a", "PENDING", 0, "t1")))
	var mu sync.Mutex
	gets := 0
	api.mux.HandleFunc("GET /v1/runs/r1", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		gets++
		n := gets
		mu.Unlock()
		if n <= 2 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, runDoc("r1", "COMPLETED", "", nodeDoc("a", "COMPLETED", 100, "t1")))
	})
	api.problem("GET /v1/runs/gone", 404, "no run gone")
	c := newCLI(t, api)

	r := c.run("runs", "start", "etl", "--wait", "--interval", "1ms")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, 3, gets)

	api.json("POST /v1/workflows/gone/runs", 201, runDoc("gone", "RUNNING", "", nodeDoc("a", "PENDING", 0, "t1")))
	r = c.run("runs", "start", "gone", "--wait", "--interval", "1ms")
	require.Equal(t, 1, r.code)
	require.Equal(t, "conveyor: no run gone (HTTP 404)\n", r.stderr)

	// Interrupted: 130.
	api.json("POST /v1/workflows/forever/runs", 201, runDoc("forever", "RUNNING", "", nodeDoc("a", "PENDING", 0, "t1")))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	time.AfterFunc(50*time.Millisecond, cancel)
	r = c.runContext(ctx, io.Discard, "runs", "start", "forever", "--wait", "--interval", "1h")
	require.Equal(t, 130, r.code)
}

func TestRunsGetCancelRetry(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/runs/{id}", 200, diamondRunning)
	cancelled := runDoc("r1", "CANCELLED", `"finished_at":"2026-11-23T11:59:30Z",`,
		nodeDoc("a", "COMPLETED", 100, "t1"), nodeDoc("b", "CANCELLED", 40, "t2", "a"), nodeDoc("c", "SKIPPED", 0, "", "b"))
	api.json("POST /v1/runs/r1/cancel", 200, cancelled)
	api.problem("POST /v1/runs/r2/cancel", 409, "run is COMPLETED and cannot be cancelled")
	api.json("POST /v1/runs/r1/retry", 200, runDoc("r1", "RUNNING", "",
		nodeDoc("a", "COMPLETED", 100, "t1"), nodeDoc("b", "PENDING", 0, "t3", "a"), nodeDoc("c", "WAITING", 0, "", "b")))
	api.problem("POST /v1/runs/r2/retry", 409, "run is COMPLETED; only FAILED or CANCELLED runs can be retried")
	api.json("GET /v1/runs/r3", 200, runDoc("r3", "RUNNING", traced, nodeDoc("a", "PENDING", 0, "t1")))
	c := newCLI(t, api)

	r := c.run("runs", "get", "0193a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, diamondDrawn, r.stdout, "no colors off a terminal")
	r = c.run("runs", "get", "0193a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, diamondRunning, r.stdout)
	r = c.run("runs", "get", "r3")
	require.Equal(t, 0, r.code, r.stderr)
	require.True(t, strings.HasSuffix(r.stdout, ": 1 pending\ntrace: http://jaeger.example:16686/trace/4bf92f3577b34da6a3ce929d0e0e4736\n"),
		"the run's trace in Jaeger ends its graph: %s", r.stdout)

	r = c.run("runs", "cancel", "r1")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "run r1 CANCELLED: 1 completed, 1 cancelled, 1 skipped\n", r.stdout)
	r = c.run("runs", "cancel", "r1", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, cancelled, r.stdout)
	r = c.run("runs", "cancel", "r2")
	require.Equal(t, 1, r.code)
	require.Equal(t, "conveyor: run is COMPLETED and cannot be cancelled (HTTP 409)\n", r.stderr)

	r = c.run("runs", "retry", "r1")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "run r1 RUNNING: 1 completed, 1 pending, 1 waiting\n", r.stdout)
	r = c.run("runs", "retry", "r2")
	require.Equal(t, 1, r.code)
	require.Equal(t, "conveyor: run is COMPLETED; only FAILED or CANCELLED runs can be retried (HTTP 409)\n", r.stderr)

	var calls []string
	for _, req := range api.recorded() {
		calls = append(calls, req.Method+" "+req.Path)
	}
	require.Equal(t, []string{"GET /v1/runs/0193a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b", "GET /v1/runs/0193a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b",
		"GET /v1/runs/r3", "POST /v1/runs/r1/cancel", "POST /v1/runs/r1/cancel", "POST /v1/runs/r2/cancel", "POST /v1/runs/r1/retry",
		"POST /v1/runs/r2/retry"}, calls)

	r = c.run("runs", "cancel")
	require.Equal(t, 2, r.code)
	require.Equal(t, "conveyor: cancel wants ID, got 0 arguments\nRun 'conveyor runs cancel --help' for usage.\n", r.stderr)
}

// On a terminal, --wait redraws the graph in place, in color: the screen
// ends with the final graph only.
func TestRunsWaitOnATerminal(t *testing.T) {
	t.Parallel()
	ptmx, tty, err := pty.Open()
	require.NoError(t, err)
	t.Cleanup(func() { _ = ptmx.Close() })
	const cols, rows = 80, 12
	require.NoError(t, pty.Setsize(ptmx, &pty.Winsize{Rows: rows, Cols: cols}))
	vt := vt10x.New(vt10x.WithSize(cols, rows))
	copied := make(chan struct{})
	go func() {
		_, _ = io.Copy(vt, ptmx)
		close(copied)
	}()

	api := newFakeAPI(t)
	api.json("POST /v1/workflows/etl/runs", 201, runDoc("r1", "RUNNING", "",
		nodeDoc("extract", "PENDING", 0, "t1"), nodeDoc("a-much-longer-node-name", "WAITING", 0, "", "extract"),
		nodeDoc("load", "WAITING", 0, "", "a-much-longer-node-name")))
	states := &runSequence{docs: []string{
		runDoc("r1", "RUNNING", "", nodeDoc("extract", "IN_PROGRESS", 30, "t1"),
			nodeDoc("a-much-longer-node-name", "WAITING", 0, "", "extract"), nodeDoc("load", "WAITING", 0, "", "a-much-longer-node-name")),
		runDoc("r1", "RUNNING", "", nodeDoc("extract", "COMPLETED", 100, "t1"),
			nodeDoc("a-much-longer-node-name", "IN_PROGRESS", 99, "0193a2b4-0000-7000-8000-00000000000b", "extract"),
			nodeDoc("load", "WAITING", 0, "", "a-much-longer-node-name")),
		runDoc("r1", "FAILED", `"error":"node load failed","finished_at":"2026-11-23T11:59:09Z",`, nodeDoc("extract", "COMPLETED", 100, "t1"),
			nodeDoc("a-much-longer-node-name", "COMPLETED", 100, "0193a2b4-0000-7000-8000-00000000000b", "extract"),
			nodeDoc("load", "FAILED", 0, "t3", "a-much-longer-node-name")),
	}}
	states.handle(api, "r1")
	c := newCLI(t, api)
	c.env["TERM"] = "xterm-256color"
	out := &teeFile{File: tty}
	res := c.runContext(context.Background(), out, "runs", "start", "etl", "--wait", "--interval", "1ms")
	require.Equal(t, 1, res.code, res.stderr)
	_ = tty.Close()
	select {
	case <-copied:
	case <-time.After(5 * time.Second):
		t.Fatal("the pty did not drain")
	}

	var screen []string
	for line := range strings.Lines(vt.String()) {
		if line = strings.TrimRight(line, " \n"); line != "" {
			screen = append(screen, line)
		}
	}
	require.Equal(t, []string{
		"run r1  etl  FAILED  (2/3 done)",
		"✓ extract                    job extract                                      …",
		"  ✓ a-much-longer-node-name  job a-much-longer-node-name  ← extract           …",
		"    ✗ load                   job load                     ← a-much-longer-node…",
		"FAILED in 9s: 2 completed, 1 failed",
		"error: node load failed",
	}, screen, "the last frame only, each line cut to the terminal's width")
	require.Contains(t, out.b.String(), "\x1b[31m\x1b[1mFAILED\x1b[0m", "in color")
	require.Contains(t, out.b.String(), "\r\x1b[6A\x1b[J", "redrawn over the previous frame")
}

// teeFile is a terminal that keeps what is written to it.
type teeFile struct {
	*os.File
	b strings.Builder
}

func (f *teeFile) Write(p []byte) (int, error) {
	f.b.Write(p)
	return f.File.Write(p)
}

func (f *teeFile) WriteString(s string) (int, error) { return f.Write([]byte(s)) }

func TestLineage(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	lineage := `{"dataset":"raw.orders","producers":[{"workflow":"nightly-etl","node":"extract","job":"extract"}],
		"consumers":[{"workflow":"nightly-etl","node":"clean","job":"clean"},{"workflow":"reports","node":"daily","job":"daily-report"}],
		"versions":[{"version":12,"run_id":"r7","node":"extract","task_id":"t70","created_at":"2026-11-23T02:00:05Z"},
			{"version":11,"created_at":"2026-11-22T02:00:05Z"}]}`
	api.mux.HandleFunc("GET /v1/lineage", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if r.URL.Query().Get("dataset") == "raw.orders" {
			_, _ = io.WriteString(w, lineage)
			return
		}
		fmt.Fprintf(w, `{"dataset":%q,"producers":[],"consumers":[],"versions":[]}`, r.URL.Query().Get("dataset"))
	})
	c := newCLI(t, api)

	r := c.run("lineage", "raw.orders")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `dataset raw.orders

written by:
  WORKFLOW     NODE     JOB
  nightly-etl  extract  extract

read by:
  WORKFLOW     NODE   JOB
  nightly-etl  clean  clean
  reports      daily  daily-report

latest versions:
  VERSION  CREATED                   AGE  RUN  NODE     TASK
  12       2026-11-23T02:00:05.000Z  9h   r7   extract  t70
  11       2026-11-22T02:00:05.000Z  33h
`, r.stdout)
	r = c.run("lineage", "raw.orders", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, lineage, r.stdout)

	r = c.run("lineage", "s3://bucket/new orders")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "dataset s3://bucket/new orders\n\nwritten by:\n  none\n\nread by:\n  none\n\nlatest versions:\n  none\n", r.stdout)
	require.Equal(t, "dataset=s3%3A%2F%2Fbucket%2Fnew+orders", api.recorded()[2].Query)

	r = c.run("lineage")
	require.Equal(t, 2, r.code)
	require.Equal(t, "conveyor: lineage wants DATASET, got 0 arguments\nRun 'conveyor lineage --help' for usage.\n", r.stderr)
}

// A terminal made narrower while --wait redraws the graph: the frames
// after it are cut to the new width. Cut to the old one, their lines wrap,
// each frame takes more lines than the redraw goes back over, and the
// screen fills with the heads of earlier frames.
func TestRunsWaitOnANarrowedTerminal(t *testing.T) {
	t.Parallel()
	ptmx, tty, err := pty.Open()
	require.NoError(t, err)
	t.Cleanup(func() { _ = ptmx.Close() })
	const cols, narrow, rows = 100, 60, 20
	require.NoError(t, pty.Setsize(ptmx, &pty.Winsize{Rows: rows, Cols: cols}))
	vt := vt10x.New(vt10x.WithSize(cols, rows))
	copied := make(chan struct{})
	go func() {
		_, _ = io.Copy(vt, ptmx)
		close(copied)
	}()

	nodes := func(status string, progress int) []string {
		return []string{nodeDoc("extract", status, progress, "0193a2b4-0000-7000-8000-00000000000a"),
			nodeDoc("a-much-longer-node-name", "WAITING", 0, "", "extract")}
	}
	api := newFakeAPI(t)
	api.json("POST /v1/workflows/etl/runs", 201, runDoc("r1", "RUNNING", "", nodes("PENDING", 0)...))
	var once sync.Once
	gets := 0
	api.mux.HandleFunc("GET /v1/runs/r1", func(w http.ResponseWriter, r *http.Request) {
		once.Do(func() {
			// The first frame is on the screen: the person narrows the
			// terminal.
			require.Eventually(t, func() bool { return strings.Contains(vt.String(), "run r1") }, 5*time.Second, time.Millisecond)
			vt.Resize(narrow, rows)
			require.NoError(t, pty.Setsize(ptmx, &pty.Winsize{Rows: rows, Cols: narrow}))
		})
		gets++
		doc := runDoc("r1", "RUNNING", "", nodes("IN_PROGRESS", 10*gets)...)
		if gets == 4 {
			doc = runDoc("r1", "COMPLETED", `"finished_at":"2026-11-23T11:59:09Z",`, nodes("COMPLETED", 100)...)
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, doc)
	})
	c := newCLI(t, api)
	c.env["TERM"] = "xterm-256color"
	res := c.runContext(context.Background(), &teeFile{File: tty}, "runs", "start", "etl", "--wait", "--interval", "1ms")
	require.Equal(t, 0, res.code, res.stderr)
	_ = tty.Close()
	select {
	case <-copied:
	case <-time.After(5 * time.Second):
		t.Fatal("the pty did not drain")
	}
	screen := vt.String()
	t.Logf("screen:\n%s", screen)
	require.Equal(t, 1, strings.Count(screen, "run r1"), "the last frame only")
	for line := range strings.Lines(screen) {
		require.LessOrEqual(t, len([]rune(strings.TrimRight(line, " \n"))), narrow-1, "cut to the narrowed terminal")
	}
}
