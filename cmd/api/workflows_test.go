package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// diamondJobs is a jobs file of four jobs and the workflow diamond: a,
// then b and c, then d. a writes wf.raw, which b and c read; d reads what
// b and c write.
const diamondJobs = `jobs:
  - {name: a, type: wf.a, payload: {step: a}}
  - {name: b, type: wf.b}
  - {name: c, type: wf.c}
  - {name: d, type: wf.d}
workflows:
  - name: diamond
    nodes:
      - {job: a, output_datasets: [wf.raw]}
      - {job: b, depends_on: [a], input_datasets: [wf.raw], output_datasets: [wf.left]}
      - {job: c, depends_on: [a], input_datasets: [wf.raw], output_datasets: [wf.right]}
      - {job: d, depends_on: [b, c], input_datasets: [wf.left, wf.right]}
`

// workflowsByName reads GET /v1/workflows.
func (b *testBundle) workflowsByName(t *testing.T) map[string]map[string]any {
	t.Helper()
	resp := b.get(t, "/v1/workflows")
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	out := map[string]map[string]any{}
	for _, w := range resp.json(t)["workflows"].([]any) {
		w := w.(map[string]any)
		out[w["name"].(string)] = w
	}
	return out
}

// runNodes returns a run's nodes by name, and their names in order.
func runNodes(t *testing.T, run map[string]any) (map[string]map[string]any, []string) {
	t.Helper()
	nodes, ok := run["nodes"].([]any)
	require.True(t, ok, "the run has nodes: %v", run)
	out := map[string]map[string]any{}
	var order []string
	for _, n := range nodes {
		n := n.(map[string]any)
		out[n["name"].(string)] = n
		order = append(order, n["name"].(string))
	}
	return out, order
}

// nodeStatuses maps each node of a run to its status.
func nodeStatuses(t *testing.T, run map[string]any) map[string]any {
	t.Helper()
	nodes, _ := runNodes(t, run)
	out := map[string]any{}
	for name, n := range nodes {
		out[name] = n["status"]
	}
	return out
}

// runIDs lists the ids of a page of runs.
func runIDs(t *testing.T, resp response) []string {
	t.Helper()
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	var ids []string
	for _, r := range resp.json(t)["runs"].([]any) {
		r := r.(map[string]any)
		require.NotContains(t, r, "nodes", "a listing leaves the nodes out")
		ids = append(ids, r["id"].(string))
	}
	return ids
}

// Applying jobs and a diamond workflow creates them; GET shows the
// workflow with its nodes, defaults filled in; applying it again changes
// nothing.
func TestApplyDeclaresWorkflows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	require.Equal(t, []string{"create job a", "create job b", "create job c", "create job d", "create workflow diamond"},
		b.applied(t, "", diamondJobs))

	flows := b.workflowsByName(t)
	require.Equal(t, []string{"diamond"}, keys(flows))
	d := flows["diamond"]
	require.Regexp(t, `^[0-9a-f]{64}$`, d["config_hash"])
	require.Equal(t, "stop", d["on_failure"], "on_failure defaults to stop")
	require.Equal(t, false, d["memoize"])
	require.Equal(t, true, d["active"])
	require.NotContains(t, d, "source")
	require.NotContains(t, d, "next_tick_at", "a workflow without a schedule has no tick")
	require.Equal(t, []any{
		map[string]any{"name": "a", "job": "a", "output_datasets": []any{"wf.raw"}},
		map[string]any{"name": "b", "job": "b", "depends_on": []any{"a"}, "input_datasets": []any{"wf.raw"}, "output_datasets": []any{"wf.left"}},
		map[string]any{"name": "c", "job": "c", "depends_on": []any{"a"}, "input_datasets": []any{"wf.raw"}, "output_datasets": []any{"wf.right"}},
		map[string]any{"name": "d", "job": "d", "depends_on": []any{"b", "c"}, "input_datasets": []any{"wf.left", "wf.right"}},
	}, d["nodes"], "node names default to their jobs'")

	one := b.get(t, "/v1/workflows/diamond")
	require.Equal(t, http.StatusOK, one.status, string(one.body))
	require.Equal(t, d, one.json(t))
	missing := b.get(t, "/v1/workflows/nope")
	require.Equal(t, http.StatusNotFound, missing.status, string(missing.body))
	require.Equal(t, "application/problem+json", missing.header.Get("Content-Type"))

	require.Equal(t, []string{"unchanged job a", "unchanged job b", "unchanged job c", "unchanged job d", "unchanged workflow diamond"},
		b.applied(t, "", diamondJobs))
	require.Equal(t, d["updated_at"], b.workflowsByName(t)["diamond"]["updated_at"], "an unchanged workflow is not rewritten")
}

// A workflow that could not run, or is not well formed, is a mistake of
// the file like any other: a 422 naming its line and what is wrong, and
// nothing of the file is applied, its valid jobs included.
func TestApplyRefusesBrokenWorkflowsWhole(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.applied(t, "", diamondJobs)
	flowsBefore, jobsBefore := b.get(t, "/v1/workflows"), b.get(t, "/v1/jobs")

	for _, c := range []struct {
		name, file string
		line       float64
		path       string
		message    *regexp.Regexp
	}{
		{
			name: "a cycle",
			file: `jobs:
  - {name: cyc-a, type: wf.x}
  - {name: cyc-b, type: wf.x}
workflows:
  - name: loop
    nodes:
      - job: cyc-a
        depends_on: [cyc-b]
      - job: cyc-b
        depends_on: [cyc-a]
`,
			line: 10, path: "workflows[0].nodes[1].depends_on[0]",
			message: regexp.MustCompile(`^cycle: cyc-a → cyc-b → cyc-a: no node of it could ever start`),
		},
		{
			name: "an unknown dependency",
			file: `jobs:
  - {name: dep-a, type: wf.x}
workflows:
  - name: broken
    nodes:
      - job: dep-a
        depends_on: [nope]
`,
			line: 7, path: "workflows[0].nodes[0].depends_on[0]",
			message: regexp.MustCompile(`^unknown node "nope" in depends_on: the workflow's nodes are dep-a$`),
		},
		{
			name: "an unknown job",
			file: `jobs:
  - {name: known, type: wf.x}
workflows:
  - name: broken
    nodes:
      - job: known
      - job: ghost
        depends_on: [known]
`,
			line: 7, path: "workflows[0].nodes[1].job",
			message: regexp.MustCompile(`^unknown job "ghost": declare it under jobs:$`),
		},
		{
			name: "depends_on that is not a list",
			file: `jobs:
  - {name: mal-a, type: wf.x}
  - {name: mal-b, type: wf.x}
workflows:
  - name: broken
    nodes:
      - job: mal-a
      - job: mal-b
        depends_on: 5
`,
			line: 9, path: "workflows[0].nodes[1].depends_on",
			message: regexp.MustCompile(`^depends_on must be a list of strings, not the integer 5$`),
		},
		{
			name: "a cycle, in JSON",
			file: "{\"jobs\": [{\"name\": \"json-a\", \"type\": \"wf.x\"}],\n" +
				"\"workflows\": [{\"name\": \"loop\", \"nodes\": [\n" +
				"  {\"name\": \"one\", \"job\": \"json-a\", \"depends_on\": [\"two\"]},\n" +
				"  {\"name\": \"two\", \"job\": \"json-a\", \"depends_on\": [\"one\"]}]}]}",
			line: 4, path: "workflows[0].nodes[1].depends_on[0]",
			message: regexp.MustCompile(`^cycle: one → two → one: `),
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			contentType := "application/yaml"
			if c.file[0] == '{' {
				contentType = "application/json"
			}
			resp := b.apply(t, "", contentType, c.file)
			require.Equal(t, http.StatusUnprocessableEntity, resp.status, string(resp.body))
			require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"))
			body := resp.json(t)
			require.Equal(t, "the file has 1 mistake(s); nothing was applied", body["detail"])
			errs := body["errors"].([]any)
			require.Len(t, errs, 1, string(resp.body))
			e := errs[0].(map[string]any)
			require.Equal(t, c.line, e["line"], "%v", e)
			require.Greater(t, e["column"], float64(0), "%v", e)
			require.Equal(t, c.path, e["path"], "%v", e)
			require.Regexp(t, c.message, e["message"])

			require.Equal(t, string(flowsBefore.body), string(b.get(t, "/v1/workflows").body), "a refused file writes no workflow")
			require.Equal(t, string(jobsBefore.body), string(b.get(t, "/v1/jobs").body), "a refused file writes none of its jobs")
			dry := b.apply(t, "?dry_run=true", contentType, c.file)
			require.Equal(t, http.StatusUnprocessableEntity, dry.status, "a dry run is refused alike: %s", dry.body)
		})
	}
}

// A run of the diamond, by hand and without a worker: it starts with a's
// task PENDING and the rest WAITING, is listed, cancels (once), and
// resumes with a new task for a. Lineage names who writes and reads a
// dataset; unknown runs and workflows are 404s; bad params are refused
// and start nothing.
func TestRunLifecycleThroughTheAPI(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.applied(t, "", diamondJobs)
	jobA := b.jobsByName(t)["a"]["id"]

	started := b.post(t, "/v1/workflows/diamond/runs", `{"params":{"day":"2026-05-01"}}`)
	require.Equal(t, http.StatusCreated, started.status, string(started.body))
	run := started.json(t)
	id := run["id"].(string)
	require.Equal(t, "/v1/runs/"+id, started.header.Get("Location"))
	require.Equal(t, "diamond", run["workflow"])
	require.Equal(t, "RUNNING", run["status"])
	require.Equal(t, "stop", run["on_failure"])
	require.Equal(t, false, run["memoize"])
	require.Equal(t, false, run["force"])
	require.Equal(t, map[string]any{"day": "2026-05-01"}, run["params"])
	require.NotContains(t, run, "finished_at")
	require.NotContains(t, run, "scheduled_at", "a run started by hand is not a tick")
	require.NotContains(t, run, "error")
	nodes, order := runNodes(t, run)
	require.Equal(t, []string{"a", "b", "c", "d"}, order, "in topological order")
	require.Equal(t, map[string]any{"a": "PENDING", "b": "WAITING", "c": "WAITING", "d": "WAITING"}, nodeStatuses(t, run))
	require.Equal(t, "SUBMITTED", nodes["a"]["state"])
	require.Equal(t, []any{}, nodes["a"]["depends_on"], "lists are never null")
	require.Equal(t, []any{"b", "c"}, nodes["d"]["depends_on"])
	require.Equal(t, []any{"wf.raw"}, nodes["b"]["input_datasets"])
	require.Equal(t, false, nodes["a"]["memoized"])
	for _, n := range []string{"b", "c", "d"} {
		require.Equal(t, "WAITING", nodes[n]["state"], n)
		require.NotContains(t, nodes[n], "task_id", n)
	}
	taskA := nodes["a"]["task_id"].(string)

	// a's task is a task of job a like any other.
	tk := b.get(t, "/v1/tasks/"+taskA)
	require.Equal(t, http.StatusOK, tk.status, string(tk.body))
	require.Equal(t, "wf.a", tk.json(t)["type"])
	require.Equal(t, "PENDING", tk.json(t)["status"])
	require.Equal(t, jobA, tk.json(t)["job_id"])
	require.Equal(t, map[string]any{"step": "a"}, tk.json(t)["payload"], "the job's payload")

	got := b.get(t, "/v1/runs/"+id)
	require.Equal(t, http.StatusOK, got.status, string(got.body))
	require.Equal(t, run, got.json(t))

	// Listings: newest first, by workflow, a page at a time.
	second := b.post(t, "/v1/workflows/diamond/runs", "")
	require.Equal(t, http.StatusCreated, second.status, string(second.body))
	other := second.json(t)["id"].(string)
	require.Equal(t, map[string]any{}, second.json(t)["params"], "params default to {}")
	require.Equal(t, []string{other, id}, runIDs(t, b.get(t, "/v1/runs")))
	require.Equal(t, []string{other, id}, runIDs(t, b.get(t, "/v1/workflows/diamond/runs")))
	require.Equal(t, []string{other, id}, runIDs(t, b.get(t, "/v1/runs?workflow=diamond")))
	require.Empty(t, runIDs(t, b.get(t, "/v1/runs?workflow=nope")))
	page := b.get(t, "/v1/runs?limit=1")
	require.Equal(t, []string{other}, runIDs(t, page))
	require.Equal(t, other, page.json(t)["next_after"])
	last := b.get(t, "/v1/runs?limit=1&after="+other)
	require.Equal(t, []string{id}, runIDs(t, last))
	require.NotContains(t, last.json(t), "next_after")
	for _, q := range []string{"limit=0", "limit=201", "limit=x", "after=not-a-uuid"} {
		resp := b.get(t, "/v1/runs?"+q)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", q, resp.body)
	}

	// Cancel: a's task is cancelled, the rest skipped; once only.
	cancelled := b.post(t, "/v1/runs/"+id+"/cancel", "")
	require.Equal(t, http.StatusOK, cancelled.status, string(cancelled.body))
	require.Equal(t, "CANCELLED", cancelled.json(t)["status"])
	require.Contains(t, cancelled.json(t), "finished_at")
	require.Equal(t, map[string]any{"a": "CANCELLED", "b": "SKIPPED", "c": "SKIPPED", "d": "SKIPPED"}, nodeStatuses(t, cancelled.json(t)))
	status, _ := b.statusOf(t, taskA)
	require.Equal(t, "CANCELLED", status)
	again := b.post(t, "/v1/runs/"+id+"/cancel", "")
	require.Equal(t, http.StatusConflict, again.status, string(again.body))
	require.Equal(t, "application/problem+json", again.header.Get("Content-Type"))
	require.Contains(t, again.json(t)["detail"], "CANCELLED")
	require.Equal(t, "CANCELLED", b.get(t, "/v1/runs/"+id).json(t)["status"], "a refused cancel changes nothing")

	// Retry: RUNNING again, a anew with a new task, the rest waiting.
	retried := b.post(t, "/v1/runs/"+id+"/retry", "")
	require.Equal(t, http.StatusOK, retried.status, string(retried.body))
	require.Equal(t, "RUNNING", retried.json(t)["status"])
	require.NotContains(t, retried.json(t), "finished_at")
	require.Equal(t, map[string]any{"a": "PENDING", "b": "WAITING", "c": "WAITING", "d": "WAITING"}, nodeStatuses(t, retried.json(t)))
	retriedNodes, _ := runNodes(t, retried.json(t))
	require.NotEqual(t, taskA, retriedNodes["a"]["task_id"], "a runs anew, as a new task")
	status, _ = b.statusOf(t, retriedNodes["a"]["task_id"].(string))
	require.Equal(t, "PENDING", status)
	busy := b.post(t, "/v1/runs/"+id+"/retry", "")
	require.Equal(t, http.StatusConflict, busy.status, "a RUNNING run cannot be retried: %s", busy.body)

	// Lineage: who writes and reads a dataset; no version before a task of
	// a writer completes.
	lineage := b.get(t, "/v1/lineage?dataset=wf.raw")
	require.Equal(t, http.StatusOK, lineage.status, string(lineage.body))
	require.Equal(t, map[string]any{
		"dataset":   "wf.raw",
		"producers": []any{map[string]any{"workflow": "diamond", "node": "a", "job": "a"}},
		"consumers": []any{
			map[string]any{"workflow": "diamond", "node": "b", "job": "b"},
			map[string]any{"workflow": "diamond", "node": "c", "job": "c"},
		},
		"versions": []any{},
	}, lineage.json(t))
	require.Equal(t, map[string]any{"dataset": "nothing.here", "producers": []any{}, "consumers": []any{}, "versions": []any{}},
		b.get(t, "/v1/lineage?dataset=nothing.here").json(t))
	noDataset := b.get(t, "/v1/lineage")
	require.Equal(t, http.StatusUnprocessableEntity, noDataset.status, string(noDataset.body))
	require.Equal(t, "dataset", noDataset.json(t)["field"])

	// Unknown runs and workflows.
	for _, c := range []struct{ method, path string }{
		{http.MethodGet, "/v1/runs/" + uuid.NewString()},
		{http.MethodGet, "/v1/runs/not-a-uuid"},
		{http.MethodPost, "/v1/runs/" + uuid.NewString() + "/cancel"},
		{http.MethodPost, "/v1/runs/" + uuid.NewString() + "/retry"},
		{http.MethodPost, "/v1/workflows/nope/runs"},
		{http.MethodGet, "/v1/workflows/nope"},
	} {
		resp := b.do(t, c.method, c.path, "", "")
		require.Equal(t, http.StatusNotFound, resp.status, "%s %s: %s", c.method, c.path, resp.body)
		require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"))
	}

	// Params that are not an object, and bodies that are not a request,
	// start nothing.
	before := runIDs(t, b.get(t, "/v1/runs"))
	for body, want := range map[string]int{
		`{"params":[1,2]}`:      http.StatusUnprocessableEntity,
		`{"params":"x"}`:        http.StatusUnprocessableEntity,
		`{"params":5}`:          http.StatusUnprocessableEntity,
		`{"force":"yes"}`:       http.StatusUnprocessableEntity,
		`[]`:                    http.StatusUnprocessableEntity,
		`{"parms":{}}`:          http.StatusBadRequest,
		`{"params":{}`:          http.StatusBadRequest,
		`{"params":{}} {"x":1}`: http.StatusBadRequest,
	} {
		resp := b.post(t, "/v1/workflows/diamond/runs", body)
		require.Equal(t, want, resp.status, "%s: %s", body, resp.body)
		require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"), body)
	}
	notJSON := b.do(t, http.MethodPost, "/v1/workflows/diamond/runs", "text/plain", `{"params":{}}`)
	require.Equal(t, http.StatusUnsupportedMediaType, notJSON.status, string(notJSON.body))
	require.Equal(t, before, runIDs(t, b.get(t, "/v1/runs")), "a refused start makes no run")
}

// When a node's task completes, the database moves the run on: its
// children are submitted, and the version of the dataset it wrote shows in
// the lineage. A worker's completion is played here through the worker
// store.
func TestRunMovesOnWhenANodeCompletes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.applied(t, "", diamondJobs)
	started := b.post(t, "/v1/workflows/diamond/runs", `{"params":{"n":1}}`)
	require.Equal(t, http.StatusCreated, started.status, string(started.body))
	id := started.json(t)["id"].(string)
	nodes, _ := runNodes(t, started.json(t))
	taskA := uuid.MustParse(nodes["a"]["task_id"].(string))

	ctx := context.Background()
	w := postgres.NewWorkerStore(b.db.Pool, nil)
	claimed, err := w.Claim(ctx, []uuid.UUID{taskA}, "w1", time.Minute)
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	_, errs, err := w.Apply(ctx, []task.Change{{TaskID: taskA, Version: claimed[0].Version, Transition: task.Complete,
		Result: json.RawMessage(`{"rows":3}`)}})
	require.NoError(t, err)
	require.NoError(t, errs[0])

	run := b.get(t, "/v1/runs/"+id).json(t)
	require.Equal(t, "RUNNING", run["status"])
	require.Equal(t, map[string]any{"a": "COMPLETED", "b": "PENDING", "c": "PENDING", "d": "WAITING"}, nodeStatuses(t, run))

	lineage := b.get(t, "/v1/lineage?dataset=wf.raw").json(t)
	versions := lineage["versions"].([]any)
	require.Len(t, versions, 1, "%v", lineage)
	v := versions[0].(map[string]any)
	require.Equal(t, id, v["run_id"])
	require.Equal(t, "a", v["node"])
	require.Equal(t, taskA.String(), v["task_id"])
	require.Greater(t, v["version"], float64(0))
	require.Equal(t, []any{}, b.get(t, "/v1/lineage?dataset=wf.left").json(t)["versions"], "b has not completed")

	// Cancelling now cancels both tasks in flight and keeps a's result.
	cancelled := b.post(t, "/v1/runs/"+id+"/cancel", "")
	require.Equal(t, http.StatusOK, cancelled.status, string(cancelled.body))
	require.Equal(t, map[string]any{"a": "COMPLETED", "b": "CANCELLED", "c": "CANCELLED", "d": "SKIPPED"}, nodeStatuses(t, cancelled.json(t)))
	retried := b.post(t, "/v1/runs/"+id+"/retry", "")
	require.Equal(t, http.StatusOK, retried.status, string(retried.body))
	require.Equal(t, map[string]any{"a": "COMPLETED", "b": "PENDING", "c": "PENDING", "d": "WAITING"}, nodeStatuses(t, retried.json(t)),
		"a retry keeps what completed and runs the rest")
}

// A run names its trace as a task does (trace_id, and trace_url when the
// trace was exported), in every answer that shows it: the trace its nodes'
// tasks join, those submitted as it starts and those its database moves on
// to later. A retry gives the run the retry's trace, which the nodes it runs
// again join.
func TestARunNamesTheTraceItsNodesJoin(t *testing.T) {
	t.Parallel()
	for _, export := range []bool{true, false} {
		t.Run(fmt.Sprintf("exported=%v", export), func(t *testing.T) {
			t.Parallel()
			b := setup(t, func(cfg *config.API) {
				if export {
					// Export on: spans are sampled; whether their export
					// succeeds does not matter here.
					cfg.OTLPEndpoint = "http://" + testenv.FreeAddr(t)
				}
			})
			b.applied(t, "", diamondJobs)
			// traceOf checks the trace an answer names and returns its id.
			traceOf := func(v map[string]any) string {
				t.Helper()
				id, _ := v["trace_id"].(string)
				require.Len(t, id, 32, "%v", v)
				if export {
					require.Equal(t, "http://jaeger.example:16686/trace/"+id, v["trace_url"])
				} else {
					require.NotContains(t, v, "trace_url", "nothing is exported: no trace to link to")
				}
				return id
			}
			taskTrace := func(id any) string {
				t.Helper()
				return traceOf(b.get(t, "/v1/tasks/"+id.(string)).json(t))
			}
			listed := func(path, id string) map[string]any {
				t.Helper()
				resp := b.get(t, path)
				require.Equal(t, http.StatusOK, resp.status, string(resp.body))
				for _, r := range resp.json(t)["runs"].([]any) {
					if r := r.(map[string]any); r["id"] == id {
						return r
					}
				}
				t.Fatalf("%s does not list run %s: %s", path, id, resp.body)
				return nil
			}

			started := b.post(t, "/v1/workflows/diamond/runs", "")
			require.Equal(t, http.StatusCreated, started.status, string(started.body))
			run := started.json(t)
			id := run["id"].(string)
			trace := traceOf(run)
			for _, v := range []map[string]any{b.get(t, "/v1/runs/"+id).json(t), listed("/v1/runs", id),
				listed("/v1/workflows/diamond/runs", id)} {
				require.Equal(t, trace, traceOf(v))
			}
			nodes, _ := runNodes(t, run)
			require.Equal(t, trace, taskTrace(nodes["a"]["task_id"]), "the first node's task joins the run's trace")

			// a completes (as a worker's batch would): the run moves on to
			// b and c, in its trace, not the completing batch's.
			ctx := context.Background()
			taskA := uuid.MustParse(nodes["a"]["task_id"].(string))
			w := postgres.NewWorkerStore(b.db.Pool, nil)
			claimed, err := w.Claim(ctx, []uuid.UUID{taskA}, "w1", time.Minute)
			require.NoError(t, err)
			require.Len(t, claimed, 1)
			_, errs, err := w.Apply(ctx, []task.Change{{TaskID: taskA, Version: claimed[0].Version, Transition: task.Complete,
				Result: json.RawMessage(`{}`), Trace: task.Carrier{"traceparent": "00-0123456789abcdef0123456789abcdef-0123456789abcdef-01"}}})
			require.NoError(t, err)
			require.NoError(t, errs[0])
			nodes, _ = runNodes(t, b.get(t, "/v1/runs/"+id).json(t))
			for _, n := range []string{"b", "c"} {
				require.Equal(t, trace, taskTrace(nodes[n]["task_id"]), "node %s joins the run's trace", n)
			}

			// Cancelled, then retried: the run takes the retry's trace, and
			// so do the nodes it runs again; a's completed task keeps its own.
			cancelled := b.post(t, "/v1/runs/"+id+"/cancel", "")
			require.Equal(t, http.StatusOK, cancelled.status, string(cancelled.body))
			require.Equal(t, trace, traceOf(cancelled.json(t)), "a cancel leaves the run its trace")
			retried := b.post(t, "/v1/runs/"+id+"/retry", "")
			require.Equal(t, http.StatusOK, retried.status, string(retried.body))
			again := traceOf(retried.json(t))
			require.NotEqual(t, trace, again, "the retry's trace")
			require.Equal(t, again, traceOf(b.get(t, "/v1/runs/"+id).json(t)))
			nodes, _ = runNodes(t, retried.json(t))
			for _, n := range []string{"b", "c"} {
				require.Equal(t, again, taskTrace(nodes[n]["task_id"]), "node %s, run again, joins the retry's trace", n)
			}
			require.Equal(t, trace, taskTrace(nodes["a"]["task_id"]), "a's task, kept, stays in the first trace")
		})
	}
}

// A run's cancel holds the run, then settles its tasks; a worker's batch
// settling one of them holds the task, then waits for the run. PostgreSQL
// rolls the cancel back (it waited first), and the cancel runs again
// instead of answering an error.
func TestRunCancelRecoversFromADeadlockWithAWorker(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.applied(t, "", diamondJobs)
	started := b.post(t, "/v1/workflows/diamond/runs", "")
	require.Equal(t, http.StatusCreated, started.status, string(started.body))
	id := started.json(t)["id"].(string)
	nodes, _ := runNodes(t, started.json(t))
	taskA := nodes["a"]["task_id"].(string)

	// What a worker's batch completing a's task holds midway: the task.
	worker, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = worker.Rollback(ctx) }()
	// PostgreSQL looks for a deadlock in the session whose wait outlasts
	// its deadlock_timeout first, and rolls that one back: this session
	// waits long, so the API's transaction is always the one.
	_, err = worker.Exec(ctx, `SET LOCAL deadlock_timeout = '30s'`)
	require.NoError(t, err)
	_, err = worker.Exec(ctx, `SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE`, taskA)
	require.NoError(t, err)

	answer := make(chan response, 1)
	go func() { answer <- b.post(t, "/v1/runs/"+id+"/cancel", "") }()
	b.db.WaitForLockWait(t)
	// The batch's trigger goes on to the run: a deadlock.
	_, err = worker.Exec(ctx, `SELECT 1 FROM workflow_runs WHERE id = $1 FOR UPDATE`, id)
	require.NoError(t, err)
	require.NoError(t, worker.Commit(ctx))

	resp := <-answer
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	require.Equal(t, "CANCELLED", resp.json(t)["status"])
	status, _ := b.statusOf(t, taskA)
	require.Equal(t, "CANCELLED", status)
}

// A node's task is retried with its run: retried alone it would complete
// while the run had skipped the nodes below it for good. The task's
// retry says so; a bulk retry leaves it out.
func TestARunsTaskIsRetriedWithItsRun(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.applied(t, "", diamondJobs)
	started := b.post(t, "/v1/workflows/diamond/runs", "")
	require.Equal(t, http.StatusCreated, started.status, string(started.body))
	id := started.json(t)["id"].(string)
	nodes, _ := runNodes(t, started.json(t))
	taskA := nodes["a"]["task_id"].(string)
	cancelled := b.post(t, "/v1/runs/"+id+"/cancel", "")
	require.Equal(t, http.StatusOK, cancelled.status, string(cancelled.body))

	retried := b.post(t, "/v1/tasks/"+taskA+"/retry", "")
	require.Equal(t, http.StatusConflict, retried.status, string(retried.body))
	require.Contains(t, retried.json(t)["detail"], "/v1/runs/"+id+"/retry")
	status, _ := b.statusOf(t, taskA)
	require.Equal(t, "CANCELLED", status, "a refused retry changes nothing")

	bulk := b.post(t, "/v1/tasks/retry", `{"filter":{"type":"wf.a"}}`)
	require.Equal(t, http.StatusOK, bulk.status, string(bulk.body))
	require.EqualValues(t, 0, bulk.json(t)["matched"], string(bulk.body))

	run := b.post(t, "/v1/runs/"+id+"/retry", "")
	require.Equal(t, http.StatusOK, run.status, string(run.body))
	require.Equal(t, "RUNNING", run.json(t)["status"])
}

// Cancelling a node's task holds the task, then its trigger waits for the
// run; a worker's batch that completed a sibling holds the run, then its
// claim waits for that task. PostgreSQL rolls the cancel back (it waited
// first), and the cancel runs again instead of answering 500.
func TestTaskCancelRecoversFromADeadlockWithAWorkersBatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.applied(t, "", diamondJobs)
	started := b.post(t, "/v1/workflows/diamond/runs", "")
	require.Equal(t, http.StatusCreated, started.status, string(started.body))
	id := started.json(t)["id"].(string)
	nodes, _ := runNodes(t, started.json(t))
	w := postgres.NewWorkerStore(b.db.Pool, nil)
	claimed, err := w.Claim(ctx, []uuid.UUID{uuid.MustParse(nodes["a"]["task_id"].(string))}, "w1", time.Minute)
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	_, errs, err := w.Apply(ctx, []task.Change{{TaskID: claimed[0].ID, Version: claimed[0].Version, Transition: task.Complete,
		Result: json.RawMessage(`{}`)}})
	require.NoError(t, err)
	require.NoError(t, errs[0])
	nodes, _ = runNodes(t, b.get(t, "/v1/runs/"+id).json(t))
	taskC := nodes["c"]["task_id"].(string)

	// What a worker's batch holds midway, having completed b: the run (the
	// completion's trigger took it).
	worker, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = worker.Rollback(ctx) }()
	_, err = worker.Exec(ctx, `SET LOCAL deadlock_timeout = '30s'`)
	require.NoError(t, err)
	_, err = worker.Exec(ctx, `SELECT 1 FROM workflow_runs WHERE id = $1 FOR UPDATE`, id)
	require.NoError(t, err)

	answer := make(chan response, 1)
	go func() { answer <- b.post(t, "/v1/tasks/"+taskC+"/cancel", "") }()
	b.db.WaitForLockWait(t)
	// The batch's claim goes on to c: a deadlock.
	_, err = worker.Exec(ctx, `SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE`, taskC)
	require.NoError(t, err)
	require.NoError(t, worker.Commit(ctx))

	resp := <-answer
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	status, _ := b.statusOf(t, taskC)
	require.Equal(t, "CANCELLED", status)
}
