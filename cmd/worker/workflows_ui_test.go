package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"

	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// The dashboard's workflows in a real browser: a diamond workflow (a → b,
// c → d) is applied through the API; a person starts a run of it from the
// workflows page, sees its graph (4 nodes in 3 columns, 4 edges; a PENDING,
// for no worker runs here, and b, c, d WAITING) and a link to its trace in
// Jaeger, cancels it with the button and sees it CANCELLED, then opens a's
// task from its node, whose trace is the run's. The api exports its traces
// to a receiver in the test: a trace not exported gets no link.

const diamondJobs = `
jobs:
  - {name: a, type: wfui.a}
  - {name: b, type: wfui.b}
  - {name: c, type: wfui.c}
  - {name: d, type: wfui.d}
workflows:
  - name: diamond
    memoize: true
    nodes:
      - {job: a}
      - {job: b, depends_on: [a]}
      - {job: c, depends_on: [a]}
      - {job: d, depends_on: [b, c]}
`

// dagNode is a node of the run page's graph as the test reads it.
type dagNode struct {
	Status string  `json:"status"`
	X      float64 `json:"x"`
	Y      float64 `json:"y"`
	Link   string  `json:"link"`
}

const readDAG = `Object.fromEntries([...document.querySelectorAll("#dag g.node")].map((g) => [g.dataset.node, {
  status: g.dataset.status, x: g.transform.baseVal[0].matrix.e, y: g.transform.baseVal[0].matrix.f,
  link: g.parentNode.getAttribute("href") || ""}]))`

func TestWorkflowsDashboardInABrowser(t *testing.T) {
	skipShort(t)
	t.Parallel()
	otlp := testenv.NewOTLPReceiver(t)
	db := testdb.New(t)
	b := setupWith(t, db.URL, db.Pool, testenv.NewVhost(t), "OTEL_EXPORTER_OTLP_ENDPOINT="+otlp.Endpoint,
		"OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf", "OTEL_BSP_SCHEDULE_DELAY=100", "JAEGER_UI_URL=http://jaeger.example:16686/")
	b.apply(t, diamondJobs)
	key := b.dashboardKey(t)

	tab := browser(t)
	signIn(t, tab, b.api, key)

	// The workflows page lists the workflow; Run (forced, with params)
	// starts a run and opens its page.
	var facts string
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/workflows"),
		chromedp.WaitVisible(`section[data-workflow="diamond"]`, chromedp.ByQuery),
		chromedp.Text(`section[data-workflow="diamond"] p.muted`, &facts, chromedp.ByQuery),
		chromedp.WaitVisible(`//section[@data-workflow="diamond"]//p[contains(., "No run yet")]`, chromedp.BySearch),
		chromedp.SetValue("#run-diamond-params", `{"day": "monday"}`, chromedp.ByID),
		chromedp.Click("#run-diamond-force", chromedp.ByID),
		chromedp.Click(`section[data-workflow="diamond"] button[type="submit"]`, chromedp.ByQuery),
		chromedp.WaitVisible(`#dag g.node[data-node="a"][data-status="PENDING"]`, chromedp.ByQuery))
	require.Contains(t, facts, "4 nodes")
	var url string
	run(t, tab, 5*time.Second, chromedp.Location(&url))
	require.Regexp(t, `/ui/runs/[0-9a-f-]{36}$`, url)

	// The graph: 4 nodes, 4 edges, a column per depth.
	var nodes map[string]dagNode
	var edges []string
	var text string
	run(t, tab, 10*time.Second,
		chromedp.Evaluate(readDAG, &nodes),
		chromedp.Evaluate(`[...document.querySelectorAll("#dag path.edge")].map((e) => e.dataset.from + ">" + e.dataset.to).sort()`, &edges),
		chromedp.Text("main", &text, chromedp.ByQuery))
	require.Len(t, nodes, 4)
	require.Equal(t, []string{"a>b", "a>c", "b>d", "c>d"}, edges)
	require.Equal(t, "PENDING", nodes["a"].Status)
	require.Regexp(t, `^/ui/tasks/[0-9a-f-]{36}$`, nodes["a"].Link, "a node with a task links to it")
	for _, n := range []string{"b", "c", "d"} {
		require.Equal(t, "WAITING", nodes[n].Status, "node %s", n)
		require.Empty(t, nodes[n].Link, "node %s has no task yet", n)
	}
	require.Less(t, nodes["a"].X, nodes["b"].X)
	require.Equal(t, nodes["b"].X, nodes["c"].X)
	require.NotEqual(t, nodes["b"].Y, nodes["c"].Y)
	require.Less(t, nodes["c"].X, nodes["d"].X)
	require.Contains(t, text, "monday", "the run's params")
	require.Contains(t, text, "this run is forced")
	require.NotContains(t, text, "undefined")
	require.NotContains(t, text, "null")
	screenshot(t, tab, "workflow-run")

	// The run's trace, the one its request started, opens in Jaeger.
	var runTrace string
	run(t, tab, 10*time.Second, chromedp.AttributeValue(`main a.trace`, "href", &runTrace, nil, chromedp.ByQuery))
	var started struct {
		TraceID  string `json:"trace_id"`
		TraceURL string `json:"trace_url"`
	}
	resp, err := b.client.Get(b.api + "/v1/runs/" + url[strings.LastIndex(url, "/")+1:])
	require.NoError(t, err)
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&started))
	resp.Body.Close()
	require.Len(t, started.TraceID, 32)
	require.Equal(t, "http://jaeger.example:16686/trace/"+started.TraceID, runTrace)
	require.Equal(t, started.TraceURL, runTrace)
	testenv.Eventually(t, 20*time.Second, func() error {
		if _, ok := find(otlp.Trace(started.TraceID), "conveyor-api", tracepb.Span_SPAN_KIND_SERVER,
			"POST /v1/workflows/{name}/runs"); !ok {
			return fmt.Errorf("the run's trace holds no request that started it: %s", describe(otlp.Trace(started.TraceID)))
		}
		return nil
	})

	// Cancel with the button (the confirmation is accepted).
	var status string
	run(t, tab, 30*time.Second,
		chromedp.Click("#cancel-run", chromedp.ByID),
		chromedp.WaitVisible(`#run-status [data-status="CANCELLED"]`, chromedp.ByQuery),
		chromedp.Text("#run-status", &status, chromedp.ByID),
		chromedp.WaitVisible("#retry-run", chromedp.ByID),
		chromedp.Evaluate(readDAG, &nodes))
	require.Equal(t, "CANCELLED", strings.TrimSpace(status))
	require.Equal(t, "CANCELLED", nodes["a"].Status)
	for _, n := range []string{"b", "c", "d"} {
		require.NotEqual(t, "WAITING", nodes[n].Status, "node %s of a cancelled run", n)
	}

	// a's node opens its task, which runs in the run's trace.
	var taskTrace string
	run(t, tab, 30*time.Second,
		chromedp.Click(`#dag g.node[data-node="a"]`, chromedp.ByQuery),
		chromedp.WaitVisible(`#status [data-status="CANCELLED"]`, chromedp.ByQuery),
		chromedp.Location(&url),
		chromedp.AttributeValue(`main a.trace`, "href", &taskTrace, nil, chromedp.ByQuery))
	require.True(t, strings.HasSuffix(url, nodes["a"].Link), "%s opens %s", url, nodes["a"].Link)
	require.Equal(t, runTrace, taskTrace, "the node's task joins the run's trace")

	// The workflows page shows the run among the latest.
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/workflows"),
		chromedp.WaitVisible(`section[data-workflow="diamond"] tr[data-run] [data-status="CANCELLED"]`, chromedp.ByQuery))
}

// A run's Cancel refused for now (a 429) says so, and the message stays
// while the page, which reads a running run again every 1.5 s, redraws:
// it does not flash and vanish before it can be read.
func TestRunPageKeepsARefusedActionsError(t *testing.T) {
	b := setup(t)
	b.apply(t, diamondJobs)
	key := b.dashboardKey(t)
	var started struct{ ID string }
	require.NoError(t, json.Unmarshal(b.post(t, "/v1/workflows/diamond/runs", map[string]any{}, http.StatusCreated), &started))

	tab := browser(t)
	signIn(t, tab, b.api, key)
	var shown string
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/runs/"+started.ID),
		chromedp.WaitVisible("#cancel-run", chromedp.ByID),
		chromedp.Evaluate(`{
			const real = window.fetch;
			window.fetch = (url, opts) => String(url).endsWith("/cancel")
				? Promise.resolve(new Response(JSON.stringify({title: "Too Many Requests", detail: "slow down"}),
					{status: 429, headers: {"Content-Type": "application/problem+json"}}))
				: real(url, opts);
		}`, nil),
		chromedp.Click("#cancel-run", chromedp.ByID),
		chromedp.WaitVisible(`main .error[role="alert"]`, chromedp.ByQuery),
		chromedp.Sleep(3*time.Second), // two redraws
		chromedp.Text(`main .error[role="alert"]`, &shown, chromedp.ByQuery))
	require.Contains(t, shown, "slow down")
}

// startSlowRun starts a run of a workflow of one node, a task that sleeps
// for a minute, and returns the run's id.
func (b *bundle) startSlowRun(t *testing.T) (started struct{ ID string }) {
	t.Helper()
	b.apply(t, `
jobs:
  - {name: slow, type: demo.sleep, payload: {steps: 600, step_ms: 100}}
workflows:
  - name: stopping
    nodes:
      - {job: slow}
`)
	require.NoError(t, json.Unmarshal(b.post(t, "/v1/workflows/stopping/runs", map[string]any{}, http.StatusCreated), &started))
	return started
}

// A run cancelled while one of its tasks runs is CANCELLED at once, but
// that task only stops when its worker hears of it: the run's page must
// keep reading the run until its tasks have stopped, not leave the node
// IN_PROGRESS for good because the run itself is over.
func TestRunPageFollowsTasksStillStoppingAfterACancel(t *testing.T) {
	b := setup(t)
	b.startWorker(t, "w-run-page")
	key := b.dashboardKey(t)
	started := b.startSlowRun(t)

	tab := browser(t)
	signIn(t, tab, b.api, key)
	var nodes map[string]dagNode
	run(t, tab, 60*time.Second,
		chromedp.Navigate(b.api+"/ui/runs/"+started.ID),
		chromedp.WaitVisible(`#dag g.node[data-node="slow"][data-status="IN_PROGRESS"]`, chromedp.ByQuery),
		chromedp.Click("#cancel-run", chromedp.ByID),
		chromedp.WaitVisible(`#run-status [data-status="CANCELLED"]`, chromedp.ByQuery))
	run(t, tab, 30*time.Second,
		chromedp.WaitVisible(`#dag g.node[data-node="slow"][data-status="CANCELLED"]`, chromedp.ByQuery),
		chromedp.Evaluate(readDAG, &nodes))
	require.Equal(t, "CANCELLED", nodes["slow"].Status)
}

// A run that failed while a node's task was still in flight is still
// stopping: it cannot be retried until that task ends, so its page offers
// to stop the task now, and then to retry the run. No worker runs: the
// node's task stays PENDING for as long as the test needs it to.
func TestRunPageStopsTheTasksOfAFailedRunStillStopping(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	started := b.startSlowRun(t)
	_, err := b.pool.Exec(context.Background(), `UPDATE workflow_runs SET status = 'FAILED', error = 'node failed: other',
		finished_at = now() WHERE id = $1`, started.ID)
	require.NoError(t, err)

	tab := browser(t)
	signIn(t, tab, b.api, key)
	var nodes map[string]dagNode
	run(t, tab, 60*time.Second,
		chromedp.Navigate(b.api+"/ui/runs/"+started.ID),
		chromedp.WaitVisible(`#dag g.node[data-node="slow"][data-status="PENDING"]`, chromedp.ByQuery),
		chromedp.Click("#stop-run-tasks", chromedp.ByID),
		chromedp.WaitVisible(`#dag g.node[data-node="slow"][data-status="CANCELLED"]`, chromedp.ByQuery),
		chromedp.WaitVisible("#retry-run", chromedp.ByID),
		chromedp.Evaluate(readDAG, &nodes))
	require.Equal(t, "CANCELLED", nodes["slow"].Status)
	var status string
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT status FROM workflow_runs WHERE id = $1`, started.ID).Scan(&status))
	require.Equal(t, "FAILED", status, "the run keeps its ending")
}

// Signed out, a person's Back shows the sign-in page, not the last page
// they saw, with its data, as the browser kept it (a run that ended reads
// nothing more that a 401 could answer): the next person at the browser
// would see it. A sign-out that failed says so.
func TestDashboardBackAfterSignOutAsksToSignIn(t *testing.T) {
	b := setup(t)
	b.apply(t, diamondJobs)
	key := b.dashboardKey(t)
	var started struct{ ID string }
	require.NoError(t, json.Unmarshal(b.post(t, "/v1/workflows/diamond/runs", map[string]any{}, http.StatusCreated), &started))
	b.post(t, "/v1/runs/"+started.ID+"/cancel", nil, http.StatusOK)

	tab := browser(t)
	signIn(t, tab, b.api, key)
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/runs/"+started.ID),
		chromedp.WaitVisible(`#run-status [data-status="CANCELLED"]`, chromedp.ByQuery))
	// A sign-out that does not reach the API (it is down) leaves the
	// session as it was: the page says so, and does not show the sign-in
	// page as if it had ended.
	var at string
	run(t, tab, 30*time.Second,
		chromedp.Evaluate(`{
			const real = window.fetch;
			window.fetch = (url, opts) => {
				if (String(url) === "/ui/logout") {
					window.fetch = real;
					return Promise.reject(new TypeError("Failed to fetch"));
				}
				return real(url, opts);
			};
		}`, nil),
		chromedp.Click("#signout", chromedp.ByID),
		chromedp.WaitVisible(`//span[@id="who"][contains(., "Not signed out")]`, chromedp.BySearch),
		chromedp.Location(&at))
	require.Contains(t, at, "/ui/runs/")
	run(t, tab, 30*time.Second,
		chromedp.Click("#signout", chromedp.ByID),
		chromedp.WaitVisible("#key", chromedp.ByID),
		// Back, from a script that has returned: chromedp's NavigateBack
		// waits for a load that a page the browser kept never fires.
		chromedp.Evaluate(`setTimeout(() => history.back(), 100)`, nil))
	// Signing out led to /ui/login; a page that finds its session over
	// sends to /ui/login?next=… (a read that meets the navigation fails,
	// and is tried again).
	require.Eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(tab, 5*time.Second)
		defer cancel()
		return chromedp.Run(ctx, chromedp.Location(&at)) == nil &&
			strings.Contains(at, "/ui/login?next="+url.QueryEscape("/ui/runs/"+started.ID))
	}, 10*time.Second, 100*time.Millisecond, "Back after signing out shows %s", at)
}
