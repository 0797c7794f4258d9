package apiclient_test

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

const workflowJSON = `{"id":"w1","name":"nightly etl","on_failure":"continue","memoize":true,
	"source":{"kind":"cron","schedule":"0 2 * * *","timezone":"UTC","missed":"run_once"},"active":true,
	"nodes":[{"name":"extract","job":"extract","output_datasets":["raw.orders"]},
		{"name":"load","job":"load","depends_on":["extract"],"input_datasets":["raw.orders"]}],
	"config_hash":"abc","next_tick_at":"2026-11-24T02:00:00Z","created_at":"2026-11-23T11:00:00Z","updated_at":"2026-11-23T11:30:00Z"}`

const runJSON = `{"id":"r1","workflow":"nightly etl","status":"RUNNING","on_failure":"continue","memoize":true,"force":true,
	"params":{"day":"2026-11-23"},"created_at":"2026-11-23T12:00:00Z","updated_at":"2026-11-23T12:00:01Z",
	"nodes":[{"name":"extract","job":"extract","depends_on":[],"input_datasets":[],"output_datasets":["raw.orders"],
		"status":"MEMOIZED","state":"MEMOIZED","task_id":"t0","progress":100,"attempt":1,"memoized":true,"memoized_from":"r0"},
	{"name":"load","job":"load","depends_on":["extract"],"input_datasets":["raw.orders"],"output_datasets":[],
		"status":"IN_PROGRESS","state":"SUBMITTED","task_id":"t1","task_state":"loading","progress":42,"attempt":1,"memoized":false}]}`

// Every workflow, run and lineage route: its method, path, query and
// body, and the answers decoded.
func TestWorkflowsRunsAndLineage(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var got []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, r.Method+" "+r.URL.EscapedPath()+" "+r.URL.RawQuery+" "+string(body))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		switch r.Method + " " + r.URL.Path {
		case "GET /v1/workflows":
			_, _ = w.Write([]byte(`{"workflows":[` + workflowJSON + `,{"id":"w2","name":"adhoc","on_failure":"stop",
				"memoize":false,"active":true,"nodes":[{"name":"a","job":"a"}],"config_hash":"def",
				"created_at":"2026-11-23T11:00:00Z","updated_at":"2026-11-23T11:00:00Z"}]}`))
		case "GET /v1/workflows/nightly etl":
			_, _ = w.Write([]byte(workflowJSON))
		case "POST /v1/workflows/nightly etl/runs":
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(runJSON))
		case "GET /v1/runs", "GET /v1/workflows/nightly etl/runs":
			_, _ = w.Write([]byte(`{"runs":[{"id":"r2","workflow":"nightly etl","status":"FAILED","on_failure":"stop",
				"memoize":false,"force":false,"params":{},"error":"node load failed","created_at":"2026-11-23T12:00:00Z",
				"updated_at":"2026-11-23T12:01:00Z","finished_at":"2026-11-23T12:01:00Z"}],"next_after":"r2"}`))
		case "POST /v1/runs/r1/cancel":
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(http.StatusConflict)
			_, _ = w.Write([]byte(`{"title":"Conflict","status":409,"detail":"run is COMPLETED and cannot be cancelled"}`))
		case "GET /v1/lineage":
			_, _ = w.Write([]byte(`{"dataset":"raw.orders","producers":[{"workflow":"nightly etl","node":"extract","job":"extract"}],
				"consumers":[{"workflow":"nightly etl","node":"load","job":"load"}],
				"versions":[{"version":7,"run_id":"r0","node":"extract","task_id":"t0","created_at":"2026-11-22T02:00:00Z"},
					{"version":6,"created_at":"2026-11-21T02:00:00Z"}]}`))
		default: // GET /v1/runs/r1, POST /v1/runs/r1/retry
			_, _ = w.Write([]byte(runJSON))
		}
	}))
	t.Cleanup(srv.Close)
	c, err := apiclient.New(apiclient.Config{URL: srv.URL})
	require.NoError(t, err)
	ctx := t.Context()

	flows, err := c.Workflows(ctx)
	require.NoError(t, err)
	require.Len(t, flows.Workflows, 2)
	wf := flows.Workflows[0]
	wf.Document = apiclient.Document{}
	require.Equal(t, apiclient.Workflow{ID: "w1", Name: "nightly etl", OnFailure: "continue", Memoize: true,
		Source: &apiclient.JobSource{Kind: "cron", Schedule: "0 2 * * *", Timezone: "UTC", Missed: "run_once"}, Active: true,
		Nodes: []apiclient.WorkflowNode{{Name: "extract", Job: "extract", OutputDatasets: []string{"raw.orders"}},
			{Name: "load", Job: "load", DependsOn: []string{"extract"}, InputDatasets: []string{"raw.orders"}}},
		ConfigHash: "abc", NextTickAt: new(time.Date(2026, 11, 24, 2, 0, 0, 0, time.UTC)),
		CreatedAt: time.Date(2026, 11, 23, 11, 0, 0, 0, time.UTC), UpdatedAt: time.Date(2026, 11, 23, 11, 30, 0, 0, time.UTC)}, wf)
	require.Nil(t, flows.Workflows[1].Source, "started only")
	require.Nil(t, flows.Workflows[1].NextTickAt)

	wf, err = c.Workflow(ctx, "nightly etl")
	require.NoError(t, err)
	require.JSONEq(t, workflowJSON, string(wf.JSON()))

	run, err := c.StartRun(ctx, "nightly etl", json.RawMessage(`{"day":"2026-11-23"}`), true)
	require.NoError(t, err)
	require.JSONEq(t, runJSON, string(run.JSON()))
	run.Document = apiclient.Document{}
	require.Equal(t, apiclient.Run{ID: "r1", Workflow: "nightly etl", Status: apiclient.RunRunning, OnFailure: "continue",
		Memoize: true, Force: true, Params: json.RawMessage(`{"day":"2026-11-23"}`),
		CreatedAt: time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC), UpdatedAt: time.Date(2026, 11, 23, 12, 0, 1, 0, time.UTC),
		Nodes: []apiclient.RunNode{
			{Name: "extract", Job: "extract", DependsOn: []string{}, InputDatasets: []string{}, OutputDatasets: []string{"raw.orders"},
				Status: apiclient.NodeMemoized, State: apiclient.NodeMemoized, TaskID: "t0", Progress: 100, Attempt: 1,
				Memoized: true, MemoizedFrom: "r0"},
			{Name: "load", Job: "load", DependsOn: []string{"extract"}, InputDatasets: []string{"raw.orders"}, OutputDatasets: []string{},
				Status: apiclient.StatusInProgress, State: apiclient.NodeSubmitted, TaskID: "t1", TaskState: "loading", Progress: 42, Attempt: 1},
		}}, run)
	require.False(t, run.Ended())
	_, err = c.StartRun(ctx, "nightly etl", nil, false)
	require.NoError(t, err)

	runs, err := c.Runs(ctx, "", "", 0)
	require.NoError(t, err)
	require.Len(t, runs.Runs, 1)
	require.Equal(t, "r2", runs.NextAfter)
	require.Equal(t, apiclient.RunFailed, runs.Runs[0].Status)
	require.True(t, runs.Runs[0].Ended())
	require.Equal(t, "node load failed", runs.Runs[0].Error)
	require.Equal(t, time.Date(2026, 11, 23, 12, 1, 0, 0, time.UTC), *runs.Runs[0].FinishedAt)
	require.Empty(t, runs.Runs[0].Nodes, "a listing has no nodes")
	_, err = c.Runs(ctx, "nightly etl", "r2", 10)
	require.NoError(t, err)

	run, err = c.Run(ctx, "r1")
	require.NoError(t, err)
	require.Len(t, run.Nodes, 2)
	_, err = c.RetryRun(ctx, "r1")
	require.NoError(t, err)
	_, err = c.CancelRun(ctx, "r1")
	e, ok := errors.AsType[*apiclient.Error](err)
	require.True(t, ok, "%T: %v", err, err)
	require.Equal(t, http.StatusConflict, e.Status)
	require.EqualError(t, err, "run is COMPLETED and cannot be cancelled (HTTP 409)")

	l, err := c.Lineage(ctx, "s3://bucket/raw orders")
	require.NoError(t, err)
	require.Equal(t, "raw.orders", l.Dataset)
	require.Equal(t, []apiclient.DatasetRef{{Workflow: "nightly etl", Node: "extract", Job: "extract"}}, l.Producers)
	require.Equal(t, []apiclient.DatasetRef{{Workflow: "nightly etl", Node: "load", Job: "load"}}, l.Consumers)
	require.Equal(t, []apiclient.DatasetVersion{
		{Version: 7, RunID: "r0", Node: "extract", TaskID: "t0", CreatedAt: time.Date(2026, 11, 22, 2, 0, 0, 0, time.UTC)},
		{Version: 6, CreatedAt: time.Date(2026, 11, 21, 2, 0, 0, 0, time.UTC)},
	}, l.Versions)

	require.Equal(t, []string{
		"GET /v1/workflows  ",
		"GET /v1/workflows/nightly%20etl  ",
		`POST /v1/workflows/nightly%20etl/runs  {"params":{"day":"2026-11-23"},"force":true}`,
		`POST /v1/workflows/nightly%20etl/runs  {}`,
		"GET /v1/runs  ",
		"GET /v1/workflows/nightly%20etl/runs after=r2&limit=10 ",
		"GET /v1/runs/r1  ",
		"POST /v1/runs/r1/retry  ",
		"POST /v1/runs/r1/cancel  ",
		"GET /v1/lineage dataset=s3%3A%2F%2Fbucket%2Fraw+orders ",
	}, got)
}
