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
	"github.com/conveyorhq/conveyor/internal/job"
)

const jobJSON = `{"id":"j1","name":"nightly-report","type":"reports.build","payload":{"format":"pdf"},"priority":7,
	"source":{"kind":"cron","schedule":"0 2 * * *","timezone":"Europe/Paris","missed":"skip"},"max_attempts":10,
	"timeout_seconds":600,"heartbeat_timeout_seconds":60,"max_concurrency":2,"max_concurrency_per_key":1,"active":true,
	"config_hash":"abc","paused":false,"next_tick_at":"2026-11-24T01:00:00Z","created_at":"2026-11-23T11:00:00Z",
	"updated_at":"2026-11-23T11:30:00Z"}`

// Every job and type route: its method, path, query, media type and body,
// and the answers decoded.
func TestJobsAndTypes(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var got []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, r.Method+" "+r.URL.EscapedPath()+" "+r.URL.RawQuery+" "+r.Header.Get("Content-Type")+" "+string(body))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		switch r.Method + " " + r.URL.Path {
		case "POST /v1/jobs/apply":
			_, _ = w.Write([]byte(`{"dry_run":true,"changes":[{"op":"create","kind":"job","name":"a","fields":[{"field":"type","old":"","new":"t"}]},
				{"op":"unchanged","kind":"type","name":"t"}]}`))
		case "GET /v1/jobs":
			_, _ = w.Write([]byte(`{"jobs":[` + jobJSON + `,{"id":"j2","name":"on-demand","type":"emails.send","payload":{},
				"priority":5,"max_attempts":3,"active":true,"config_hash":"def","paused":true,"paused_at":"2026-11-23T11:45:00Z",
				"created_at":"2026-11-23T11:00:00Z","updated_at":"2026-11-23T11:00:00Z"}]}`))
		case "POST /v1/jobs/nightly-report/trigger":
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(`{"id":"t1","type":"reports.build","status":"PENDING","job_id":"j1","concurrency_key":"k",
				"waiting":true,"timeout_seconds":600,"created_at":"2026-11-23T12:00:00Z"}`))
		case "GET /v1/types":
			_, _ = w.Write([]byte(`{"types":[{"type":"emails.send","max_concurrency":10,"paused":false},
				{"type":"reports.build","paused":true,"paused_at":"2026-11-23T11:50:00Z"}]}`))
		case "POST /v1/types/demo.sleep/pause", "POST /v1/types/demo.sleep/resume":
			_, _ = w.Write([]byte(`{"type":"demo.sleep","paused":true,"paused_at":"2026-11-23T11:50:00Z"}`))
		default:
			_, _ = w.Write([]byte(jobJSON))
		}
	}))
	t.Cleanup(srv.Close)
	c, err := apiclient.New(apiclient.Config{URL: srv.URL})
	require.NoError(t, err)
	ctx := t.Context()

	file := []byte("jobs:\n  - name: a\n    type: t\n")
	res, err := c.Apply(ctx, file, apiclient.ApplyOptions{DryRun: true})
	require.NoError(t, err)
	require.True(t, res.DryRun)
	require.Equal(t, []job.Change{
		{Op: job.OpCreate, Kind: job.KindJob, Name: "a", Fields: []job.FieldChange{{Field: "type", New: "t"}}},
		{Op: job.OpUnchanged, Kind: job.KindType, Name: "t"},
	}, res.Changes)
	_, err = c.Apply(ctx, file, apiclient.ApplyOptions{Prune: true})
	require.NoError(t, err)

	jobs, err := c.Jobs(ctx)
	require.NoError(t, err)
	require.Len(t, jobs.Jobs, 2)
	j := jobs.Jobs[0]
	j.Document = apiclient.Document{}
	require.Equal(t, apiclient.Job{ID: "j1", Name: "nightly-report", Type: "reports.build", Payload: json.RawMessage(`{"format":"pdf"}`),
		Priority: 7, Source: &apiclient.JobSource{Kind: "cron", Schedule: "0 2 * * *", Timezone: "Europe/Paris", Missed: "skip"},
		MaxAttempts: 10, TimeoutSeconds: 600, HeartbeatTimeoutSeconds: 60, MaxConcurrency: 2, MaxConcurrencyPerKey: 1,
		Active: true, ConfigHash: "abc", NextTickAt: new(time.Date(2026, 11, 24, 1, 0, 0, 0, time.UTC)),
		CreatedAt: time.Date(2026, 11, 23, 11, 0, 0, 0, time.UTC), UpdatedAt: time.Date(2026, 11, 23, 11, 30, 0, 0, time.UTC)}, j)
	require.Nil(t, jobs.Jobs[1].Source, "triggered only")
	require.True(t, jobs.Jobs[1].Paused)

	j, err = c.Job(ctx, "nightly report")
	require.NoError(t, err)
	require.JSONEq(t, jobJSON, string(j.JSON()))

	tk, err := c.TriggerJob(ctx, "nightly-report", apiclient.TriggerRequest{Payload: json.RawMessage(`{"format":"csv"}`), ConcurrencyKey: "k"})
	require.NoError(t, err)
	require.Equal(t, "j1", tk.JobID)
	require.Equal(t, "k", tk.ConcurrencyKey)
	require.True(t, tk.Waiting)
	require.Equal(t, 600, tk.TimeoutSeconds)
	_, err = c.TriggerJob(ctx, "nightly-report", apiclient.TriggerRequest{})
	require.NoError(t, err)

	_, err = c.PauseJob(ctx, "nightly-report")
	require.NoError(t, err)
	_, err = c.ResumeJob(ctx, "nightly-report")
	require.NoError(t, err)

	types, err := c.Types(ctx)
	require.NoError(t, err)
	require.Len(t, types.Types, 2)
	require.Equal(t, 10, types.Types[0].MaxConcurrency)
	require.True(t, types.Types[1].Paused)
	require.Equal(t, time.Date(2026, 11, 23, 11, 50, 0, 0, time.UTC), *types.Types[1].PausedAt)
	st, err := c.PauseType(ctx, "demo.sleep")
	require.NoError(t, err)
	require.True(t, st.Paused)
	_, err = c.ResumeType(ctx, "demo.sleep")
	require.NoError(t, err)

	require.Equal(t, []string{
		"POST /v1/jobs/apply dry_run=true&prune=false application/yaml jobs:\n  - name: a\n    type: t\n",
		"POST /v1/jobs/apply dry_run=false&prune=true application/yaml jobs:\n  - name: a\n    type: t\n",
		"GET /v1/jobs   ",
		"GET /v1/jobs/nightly%20report   ",
		`POST /v1/jobs/nightly-report/trigger  application/json {"payload":{"format":"csv"},"concurrency_key":"k"}`,
		`POST /v1/jobs/nightly-report/trigger  application/json {}`,
		"POST /v1/jobs/nightly-report/pause   ",
		"POST /v1/jobs/nightly-report/resume   ",
		"GET /v1/types   ",
		"POST /v1/types/demo.sleep/pause   ",
		"POST /v1/types/demo.sleep/resume   ",
	}, got)
}

// A jobs file the API refuses: every mistake, with its line, on the *Error.
func TestApplyRefusedListsTheMistakes(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusUnprocessableEntity)
		_, _ = w.Write([]byte(`{"type":"urn:conveyor:problem:invalid","title":"Unprocessable Entity","status":422,
			"detail":"the file has 2 mistake(s); nothing was applied","instance":"/v1/jobs/apply","errors":[
			{"line":4,"column":5,"path":"jobs[0].type","message":"\"type\" is required"},
			{"line":9,"column":17,"path":"jobs[1].source.schedule","message":"bad schedule"}]}`))
	}))
	t.Cleanup(srv.Close)
	c, err := apiclient.New(apiclient.Config{URL: srv.URL})
	require.NoError(t, err)

	_, err = c.Apply(t.Context(), []byte("jobs: []"), apiclient.ApplyOptions{})
	e, ok := errors.AsType[*apiclient.Error](err)
	require.True(t, ok, "%T: %v", err, err)
	require.Equal(t, 422, e.Status)
	require.Equal(t, job.Problems{
		{Line: 4, Column: 5, Path: "jobs[0].type", Message: `"type" is required`},
		{Line: 9, Column: 17, Path: "jobs[1].source.schedule", Message: "bad schedule"},
	}, e.Problems)
	require.EqualError(t, err, "the file has 2 mistake(s); nothing was applied (HTTP 422)")
}

// Submit sends the concurrency key and the timeouts, in whole seconds, and
// leaves them out when not given.
func TestSubmitSchedulingFields(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var bodies []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies = append(bodies, string(body))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"t1","type":"t","status":"PENDING","created_at":"2026-11-23T12:00:00Z"}`))
	}))
	t.Cleanup(srv.Close)
	c, err := apiclient.New(apiclient.Config{URL: srv.URL})
	require.NoError(t, err)

	_, _, err = c.Submit(t.Context(), apiclient.SubmitRequest{Type: "t", ConcurrencyKey: "acct-1", TimeoutSeconds: 90,
		HeartbeatTimeoutSeconds: 15}, "")
	require.NoError(t, err)
	_, _, err = c.Submit(t.Context(), apiclient.SubmitRequest{Type: "t"}, "")
	require.NoError(t, err)
	require.Equal(t, []string{
		`{"type":"t","concurrency_key":"acct-1","timeout_seconds":90,"heartbeat_timeout_seconds":15}`,
		`{"type":"t"}`,
	}, bodies)
}
