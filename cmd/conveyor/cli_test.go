package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/apiclient"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// These tests run the command line in the test process against a fake
// API (httptest), so that its output can be compared to the character.

// testNow is the clock of every in-process run.
var testNow = time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)

// fakeAPI is an httptest server with the routes a test gives it; it
// records every request it answers.
type fakeAPI struct {
	t   *testing.T
	srv *httptest.Server
	mux *http.ServeMux

	mu       sync.Mutex
	requests []recorded
}

type recorded struct {
	Method, Path, Query, Auth, IdempotencyKey, ContentType, Body string
}

func newFakeAPI(t *testing.T) *fakeAPI {
	t.Helper()
	f := &fakeAPI{t: t, mux: http.NewServeMux()}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.requests = append(f.requests, recorded{Method: r.Method, Path: r.URL.Path, Query: r.URL.RawQuery,
			Auth: r.Header.Get("Authorization"), IdempotencyKey: r.Header.Get("Idempotency-Key"),
			ContentType: r.Header.Get("Content-Type"), Body: string(body)})
		f.mu.Unlock()
		r.Body = io.NopCloser(bytes.NewReader(body))
		f.mux.ServeHTTP(w, r)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

// json answers a route with status and a JSON body.
func (f *fakeAPI) json(pattern string, status int, body string) {
	f.mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		fmt.Fprintf(w, "%s", body)
	})
}

// problem answers a route with a problem document.
func (f *fakeAPI) problem(pattern string, status int, detail string) {
	f.mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(status)
		fmt.Fprintf(w, `{"type":"urn:conveyor:problem:x","title":%q,"status":%d,"detail":%q,"instance":%q}`,
			http.StatusText(status), status, detail, r.URL.Path)
	})
}

// stream answers a task's stream with its events, then its end.
func (f *fakeAPI) stream(taskID string, events ...string) {
	f.mux.HandleFunc("GET /v1/tasks/"+taskID+"/stream", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprintf(w, "retry: 2000\n\n")
		var last struct {
			Status string `json:"status"`
		}
		for _, e := range events {
			require.NoError(f.t, json.Unmarshal([]byte(e), &last))
			var id struct {
				ID int64 `json:"id"`
			}
			require.NoError(f.t, json.Unmarshal([]byte(e), &id))
			fmt.Fprintf(w, "id: %d\nevent: task\ndata: %s\n\n: heartbeat\n\n", id.ID, e)
		}
		fmt.Fprintf(w, "event: end\ndata: {\"task_id\":%q,\"status\":%q}\n\n", taskID, last.Status)
	})
}

func (f *fakeAPI) recorded() []recorded {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]recorded(nil), f.requests...)
}

// cli runs the command line in the test process.
type cli struct {
	t         *testing.T
	env       map[string]string
	configDir string
	stdin     io.Reader
	// terminal makes stdin a terminal, where a person answers questions.
	terminal bool
}

type result struct {
	stdout, stderr string
	code           int
}

// newCLI returns a command line configured for api (by CONVEYOR_URL and
// CONVEYOR_TOKEN) with an empty config directory.
func newCLI(t *testing.T, api *fakeAPI) *cli {
	c := &cli{t: t, env: map[string]string{}, configDir: t.TempDir()}
	if api != nil {
		c.env["CONVEYOR_URL"] = api.srv.URL
		c.env["CONVEYOR_TOKEN"] = "cvk_test"
	}
	return c
}

func (c *cli) run(args ...string) result {
	return c.runContext(context.Background(), &bytes.Buffer{}, args...)
}

func (c *cli) runContext(ctx context.Context, stdout io.Writer, args ...string) result {
	c.t.Helper()
	var stderr bytes.Buffer
	stdin := c.stdin
	if stdin == nil {
		stdin = strings.NewReader("")
	}
	e := env{stdin: stdin, stdinTerminal: c.terminal, stdout: stdout, stderr: &stderr,
		getenv:        func(k string) string { return c.env[k] },
		userConfigDir: func() (string, error) { return c.configDir, nil },
		now:           func() time.Time { return testNow }}
	code := exitCode(&stderr, run(ctx, args, e))
	out := ""
	if b, ok := stdout.(fmt.Stringer); ok {
		out = b.String()
	}
	return result{stdout: out, stderr: stderr.String(), code: code}
}

func TestConfigPrecedence(t *testing.T) {
	t.Parallel()
	file := "url: http://file:1\ntoken: file-token\n"
	for name, tc := range map[string]struct {
		file    string // the default config file's content; "" for none
		env     map[string]string
		args    []string
		want    config
		wantErr string
	}{
		"defaults":  {want: config{URL: defaultURL}},
		"file":      {file: file, want: config{URL: "http://file:1", Token: "file-token"}},
		"env":       {file: file, env: map[string]string{"CONVEYOR_URL": "http://env:2", "CONVEYOR_TOKEN": "env-token"}, want: config{URL: "http://env:2", Token: "env-token"}},
		"key":       {file: file, env: map[string]string{"CONVEYOR_KEY": "make-run-key"}, want: config{URL: "http://file:1", Token: "make-run-key"}},
		"token>key": {env: map[string]string{"CONVEYOR_TOKEN": "t", "CONVEYOR_KEY": "k"}, want: config{URL: defaultURL, Token: "t"}},
		"flags": {file: file, env: map[string]string{"CONVEYOR_URL": "http://env:2", "CONVEYOR_TOKEN": "env-token"},
			args: []string{"--url", "http://flag:3", "--token", "flag-token"}, want: config{URL: "http://flag:3", Token: "flag-token"}},
		"flag url only": {file: file, args: []string{"--url", "http://flag:3"}, want: config{URL: "http://flag:3", Token: "file-token"}},
		"--config": {file: "url: http://ignored:9\n", args: []string{"--config", "OTHER"},
			want: config{URL: "http://other:4", Token: "other-token"}},
		"--config missing": {args: []string{"--config", "MISSING"}, wantErr: "no such file"},
		"unknown key":      {file: "url: http://file:1\ntokn: typo\n", wantErr: `line 2: unknown key "tokn" (the keys are url and token)`},
		"not a mapping":    {file: "- url\n", wantErr: "line 1: want the keys url and token"},
		"not a string":     {file: "url: http://file:1\ntoken:\n  - a\n", wantErr: "line 3: token must be a string, such as token: cvk_…"},
		"only a comment":   {file: "# nothing yet\n", want: config{URL: defaultURL}},
		"empty file":       {file: "\n", want: config{URL: defaultURL}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			if tc.file != "" {
				require.NoError(t, os.MkdirAll(filepath.Join(dir, "conveyor"), 0o700))
				require.NoError(t, os.WriteFile(filepath.Join(dir, "conveyor", "config.yaml"), []byte(tc.file), 0o600))
			}
			other := filepath.Join(dir, "other.yaml")
			require.NoError(t, os.WriteFile(other, []byte("url: http://other:4\ntoken: other-token\n"), 0o600))
			args := make([]string, len(tc.args))
			for i, a := range tc.args {
				args[i] = strings.NewReplacer("OTHER", other, "MISSING", filepath.Join(dir, "missing.yaml")).Replace(a)
			}

			a := &app{}
			root := a.rootCommand()
			require.NoError(t, root.ParseFlags(args))
			got, err := loadConfig(root.Flags(), a.flags, func(k string) string { return tc.env[k] },
				func() (string, error) { return dir, nil })
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

// The configuration reaches the requests: the URL and the bearer token.
func TestConfigReachesTheAPI(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/whoami", 200, `{"kind":"key","id":"k1","name":"ci","org_id":"o1","org":"acme","role":"admin","org_roles":["finance","ops"]}`)
	c := newCLI(t, nil)
	require.NoError(t, os.MkdirAll(filepath.Join(c.configDir, "conveyor"), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(c.configDir, "conveyor", "config.yaml"),
		[]byte("url: "+api.srv.URL+"\ntoken: from-file\n"), 0o600))

	r := c.run("whoami")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `kind:      key
id:        k1
name:      ci
org:       acme
org id:    o1
role:      admin
org roles: finance, ops
api:       `+api.srv.URL+"\n", r.stdout)

	c.env["CONVEYOR_KEY"] = "from-env"
	require.Equal(t, 0, c.run("whoami", "-o", "json").code)
	require.Equal(t, 0, c.run("whoami", "--token", "from-flag").code)
	var auth []string
	for _, req := range api.recorded() {
		auth = append(auth, req.Auth)
	}
	require.Equal(t, []string{"Bearer from-file", "Bearer from-env", "Bearer from-flag"}, auth)
}

const taskJSON = `{"id":"0193a2b4-0000-7000-8000-000000000001","org_id":"o1","visibility":["finance"],"type":"demo.sleep",
	"status":"FAILED","state":"Step 2/5","progress":40,"priority":7,"payload":{"steps":5,"step_ms":200,"n":1.50},
	"metadata":{"team":"billing"},"attempt":3,"max_attempts":3,"error":"demo.sleep: boom","idempotency_key":"order-42",
	"version":9,"worker_id":"w1","next_run_at":"2026-11-23T11:58:00Z","created_at":"2026-11-23T11:58:00Z",
	"updated_at":"2026-11-23T11:59:30.5Z","started_at":"2026-11-23T11:58:01Z","completed_at":"2026-11-23T11:59:30.5Z",
	"trace_id":"abc","trace_url":"http://localhost:16686/trace/abc","future_field":true}`

func TestGetShowsTheTask(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/tasks/{id}", 200, taskJSON)
	c := newCLI(t, api)

	r := c.run("get", "0193a2b4-0000-7000-8000-000000000001")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `id:              0193a2b4-0000-7000-8000-000000000001
type:            demo.sleep
status:          FAILED
progress:        40%
state:           Step 2/5
error:           demo.sleep: boom
attempt:         3 of 3
priority:        7
visibility:      finance
idempotency key: order-42
worker:          w1
created:         2026-11-23T11:58:00.000Z
started:         2026-11-23T11:58:01.000Z
completed:       2026-11-23T11:59:30.500Z
updated:         2026-11-23T11:59:30.500Z
payload:         {"steps":5,"step_ms":200,"n":1.50}
metadata:        {"team":"billing"}
trace:           http://localhost:16686/trace/abc
`, r.stdout)

	// JSON is the API's document, fields this client does not know and
	// numbers as written included.
	r = c.run("get", "0193a2b4-0000-7000-8000-000000000001", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, taskJSON, r.stdout)
	require.Contains(t, r.stdout, `"n": 1.50`)
}

func TestListShowsATable(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/tasks", 200, `{"tasks":[
		{"id":"0193a2b4-0000-7000-8000-000000000003","type":"demo.sleep","status":"IN_PROGRESS","state":"Step 2/5","progress":40,"created_at":"2026-11-23T11:59:15Z","updated_at":"2026-11-23T11:59:58Z"},
		{"id":"0193a2b4-0000-7000-8000-000000000002","type":"images.resize","status":"PENDING","state":"Queued\twith\na tab","progress":0,"created_at":"2026-11-23T11:00:00Z","updated_at":"2026-11-23T11:00:00Z"},
		{"id":"0193a2b4-0000-7000-8000-000000000001","type":"demo.noop","status":"COMPLETED","state":"A state far too long for the table's column, which cuts it","progress":100,"created_at":"2026-11-20T12:00:00Z","updated_at":"2026-11-21T11:00:00Z"}
	],"next_cursor":"Q1VSU09S"}`)
	c := newCLI(t, api)

	r := c.run("ls", "--status", "in_progress", "--type", "demo.sleep", "--limit", "3")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `ID                                    TYPE           STATUS       PROGRESS  STATE                                     AGE  UPDATED
0193a2b4-0000-7000-8000-000000000003  demo.sleep     IN_PROGRESS  40%       Step 2/5                                  45s  2s
0193a2b4-0000-7000-8000-000000000002  images.resize  PENDING      0%        Queued with a tab                         1h   1h
0193a2b4-0000-7000-8000-000000000001  demo.noop      COMPLETED    100%      A state far too long for the table's co…  3d   2d
`, r.stdout)
	require.Equal(t, "more: conveyor ls --status IN_PROGRESS --type demo.sleep --limit 3 --cursor Q1VSU09S\n", r.stderr,
		"the next page's command repeats the filters, which the cursor does not carry")
	require.Equal(t, "limit=3&status=IN_PROGRESS&type=demo.sleep", api.recorded()[0].Query)

	r = c.run("ls", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, `"next_cursor": "Q1VSU09S"`)
}

// --all follows the cursors to the last page.
func TestListAllPages(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.mux.HandleFunc("GET /v1/tasks", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Query().Get("cursor") {
		case "":
			fmt.Fprintf(w, `{"tasks":[{"id":"a","type":"t","status":"PENDING","created_at":"2026-11-23T11:59:00Z"}],"next_cursor":"c1"}`)
		case "c1":
			fmt.Fprintf(w, `{"tasks":[{"id":"b","type":"t","status":"PENDING","created_at":"2026-11-23T11:59:00Z"}]}`)
		}
	})
	c := newCLI(t, api)
	r := c.run("ls", "--all", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	var out struct {
		Tasks []struct{ ID string } `json:"tasks"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &out))
	require.Len(t, out.Tasks, 2)
	require.Equal(t, "b", out.Tasks[1].ID)

	r = c.run("ls", "--all")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, 3, strings.Count(r.stdout, "\n"), r.stdout)
	require.Empty(t, r.stderr, "no next page to point at")
}

// --all -o json of a filter that matches nothing is the API's empty list,
// not null: a script's `jq '.tasks[]'` iterates over nothing instead of
// failing.
func TestListAllPagesJSONWhenNothingMatches(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/tasks", 200, `{"tasks":[]}`)
	r := newCLI(t, api).run("ls", "--all", "-t", "nothing.here", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, `{"tasks":[]}`, r.stdout)
}

// The filters reach the API's query: a duration is that long before now,
// an RFC 3339 time goes as written.
func TestListFilters(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/tasks", 200, `{"tasks":[]}`)
	c := newCLI(t, api)

	r := c.run("ls", "--created-after", "1h", "--created-before", "2026-11-23T11:30:00+01:00", "--q", "team=billing",
		"-s", "failed", "-t", "demo.sleep")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "ID  TYPE  STATUS  PROGRESS  STATE  AGE  UPDATED\n", r.stdout)
	q, err := url.ParseQuery(api.recorded()[0].Query)
	require.NoError(t, err)
	require.Equal(t, url.Values{"created_after": {"2026-11-23T11:00:00Z"}, "created_before": {"2026-11-23T11:30:00+01:00"},
		"q": {"team=billing"}, "status": {"FAILED"}, "type": {"demo.sleep"}}, q)

	r = c.run("ls", "--created-before", "90m", "--q", "0193a2b4-0000-7000-8000-000000000001")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "created_before=2026-11-23T10%3A30%3A00Z&q=0193a2b4-0000-7000-8000-000000000001", api.recorded()[1].Query)
}

const overviewJSON = `{"counts":{"PENDING":3,"IN_PROGRESS":1,"COMPLETED":120,"FAILED":2,"CANCELLED":4},
	"last_hour":{"minutes":[{"minute":"2026-11-23T11:01:00Z","completed":57,"failed":2}],"completed":57,"failed":2,"throughput_per_minute":0.95},
	"types":[
		{"type":"demo.sleep","pending":2,"scheduled":1,"running":1,"oldest_pending_age_seconds":75.5},
		{"type":"images.resize","pending":0,"scheduled":1,"running":0,"oldest_pending_age_seconds":0}],
	"outbox":{"depth":2,"oldest_age_seconds":3.2,"parked":1},
	"workers":[
		{"id":"w-a","hostname":"host-a","types":["demo.sleep","demo.noop"],"concurrency":4,"version":"v1.2.0","last_heartbeat_at":"2026-11-23T11:59:58Z",
		 "running":[{"id":"0193a2b4-0000-7000-8000-000000000003","type":"demo.sleep"}]},
		{"id":"w-b","hostname":"host-b","types":["images.resize"],"concurrency":16,"version":"v1.2.0","last_heartbeat_at":"2026-11-23T11:59:55Z","running":[]}],
	"leader":"w-b","future_field":1}`

func TestOverview(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/overview", 200, overviewJSON)
	c := newCLI(t, api)

	r := c.run("overview")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `tasks:     PENDING 3  IN_PROGRESS 1  COMPLETED 120  FAILED 2  CANCELLED 4
last hour: 57 completed, 2 failed, 0.95 completed per minute

TYPE           WAITING  SCHEDULED  RUNNING  OLDEST
demo.sleep     2        1          1        1m
images.resize  0        1          0

outbox: 2 due, the oldest for 3s, 1 parked (waiting for a worker of their type)

ID            HOST    TYPES                 CONCURRENCY  HEARTBEAT  RUNNING
w-a           host-a  demo.sleep,demo.noop  4            2s         1
w-b (leader)  host-b  images.resize         16           5s         0
`, r.stdout)
	require.Equal(t, "/v1/overview", api.recorded()[0].Path)

	// JSON is the API's document as it came.
	r = c.run("overview", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, overviewJSON, r.stdout)
}

// A quiet org: nothing queued, no worker, no leader.
func TestOverviewWhenQuiet(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/overview", 200, `{"counts":{"PENDING":0,"IN_PROGRESS":0,"COMPLETED":0,"FAILED":0,"CANCELLED":0,"PAUSED":1},
		"last_hour":{"minutes":[],"completed":0,"failed":0,"throughput_per_minute":0},"types":[],
		"outbox":{"depth":0,"oldest_age_seconds":0,"parked":0},"workers":[],"leader":null}`)
	r := newCLI(t, api).run("overview")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `tasks:     PENDING 0  IN_PROGRESS 0  COMPLETED 0  FAILED 0  CANCELLED 0  PAUSED 1
last hour: 0 completed, 0 failed, 0.00 completed per minute

no task is waiting or running

outbox: 0 due, 0 parked (waiting for a worker of their type)

no worker heard from in the last minute
`, r.stdout)
}

func TestEventsShowsTheHistoryOldestFirst(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/tasks/{id}/events", 200, `{"events":[
		{"id":3,"task_id":"t","status":"PENDING","state":"Retry scheduled","progress":20,"actor":"WORKER","error":"boom","created_at":"2026-11-23T11:59:02Z"},
		{"id":2,"task_id":"t","status":"IN_PROGRESS","state":"Running","progress":0,"actor":"WORKER","created_at":"2026-11-23T11:59:01Z"},
		{"id":1,"task_id":"t","status":"PENDING","state":"Queued","progress":0,"actor":"API","by":{"kind":"key","id":"k1","name":"billing"},"created_at":"2026-11-23T11:59:00Z"}
	]}`)
	c := newCLI(t, api)

	r := c.run("events", "t", "--limit", "3")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `ID  TIME                      STATUS       PROGRESS  ACTOR   BY           STATE            ERROR
1   2026-11-23T11:59:00.000Z  PENDING      0%        API     key billing  Queued
2   2026-11-23T11:59:01.000Z  IN_PROGRESS  0%        WORKER               Running
3   2026-11-23T11:59:02.000Z  PENDING      20%       WORKER               Retry scheduled  boom
`, r.stdout)
	require.Equal(t, "limit=3", api.recorded()[0].Query)
}

func TestSubmitSendsTheRequest(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("POST /v1/tasks", 201, `{"id":"new-id","type":"demo.sleep","status":"PENDING","created_at":"2026-11-23T12:00:00Z"}`)
	dir := t.TempDir()
	file := filepath.Join(dir, "payload.json")
	require.NoError(t, os.WriteFile(file, []byte(`{"from":"file"}`), 0o600))

	for name, tc := range map[string]struct {
		args  []string
		stdin string
		want  string // the request's body
		key   string
	}{
		"no payload": {args: []string{"demo.noop"}, want: `{"type":"demo.noop"}`},
		// The payload's numbers are sent as written (the API hashes their
		// exact text); only the white space between tokens goes.
		"flag": {args: []string{"demo.sleep", "--payload", `{"steps":5, "step_ms":200, "x":1.0, "big":9007199254740993}`},
			want: `{"type":"demo.sleep","payload":{"steps":5,"step_ms":200,"x":1.0,"big":9007199254740993}}`},
		"file":  {args: []string{"demo.sleep", "--payload-file", file}, want: `{"type":"demo.sleep","payload":{"from":"file"}}`},
		"stdin": {args: []string{"demo.sleep"}, stdin: "{\"from\":\"stdin\"}\n", want: `{"type":"demo.sleep","payload":{"from":"stdin"}}`},
		"dash":  {args: []string{"demo.sleep", "-f", "-"}, stdin: `{"from":"dash"}`, want: `{"type":"demo.sleep","payload":{"from":"dash"}}`},
		"every field": {args: []string{"demo.sleep", "-p", "{}", "--priority", "0", "--max-attempts", "1", "--metadata", `{"team":"b"}`,
			"--visibility", "finance,ops", "--visibility", "hr", "--no-dedupe", "-k", "order-42"},
			want: `{"type":"demo.sleep","payload":{},"priority":0,"metadata":{"team":"b"},"max_attempts":1,"dedupe":false,"visibility":["finance","ops","hr"]}`,
			key:  "order-42"},
		"delay":  {args: []string{"demo.noop", "--delay", "90s"}, want: `{"type":"demo.noop","delay":"90s"}`},
		"run at": {args: []string{"demo.noop", "--run-at", "2026-11-23T18:00:00+01:00"}, want: `{"type":"demo.noop","run_at":"2026-11-23T18:00:00+01:00"}`},
	} {
		t.Run(name, func(t *testing.T) {
			c := newCLI(t, api)
			c.stdin = strings.NewReader(tc.stdin)
			r := c.run(append([]string{"submit"}, tc.args...)...)
			require.Equal(t, 0, r.code, r.stderr)
			require.Equal(t, "new-id\n", r.stdout)
			var got *recorded
			for _, req := range api.recorded() {
				if req.Body == tc.want {
					got = &req
				}
			}
			require.NotNil(t, got, "no request with body %s in %+v", tc.want, api.recorded())
			require.Equal(t, tc.key, got.IdempotencyKey)
		})
	}
}

func TestSubmitDuplicate(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("POST /v1/tasks", 200, `{"id":"old-id","type":"demo.sleep","status":"COMPLETED","created_at":"2026-11-23T12:00:00Z"}`)
	r := newCLI(t, api).run("submit", "demo.sleep", "-p", `{"steps":1}`)
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "old-id\n", r.stdout)
	require.Equal(t, "conveyor: the same input as task old-id (COMPLETED), which is not submitted again (unless --no-dedupe)\n", r.stderr)
}

// Errors: the API's problem documents as "conveyor: detail (HTTP status)"
// and exit 1; a command used wrongly exits 2 before any request.
func TestErrors(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.problem("GET /v1/tasks/{id}", 404, "no task 0193a2b4-0000-7000-8000-00000000000f")
	api.problem("POST /v1/tasks", 422, "priority: must be an integer from 0 to 9")
	api.problem("POST /v1/tasks/{id}/cancel", 409, "task is COMPLETED: it cannot be cancelled")
	api.problem("GET /v1/keys", 403, "needs the admin role")
	api.mux.HandleFunc("GET /v1/whoami", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(http.StatusBadGateway)
		fmt.Fprintf(w, "<html>bad gateway</html>")
	})

	// A config file's mistake is the caller's, as a bad --url is: exit 2.
	dir := t.TempDir()
	typo := filepath.Join(dir, "typo.yaml")
	require.NoError(t, os.WriteFile(typo, []byte("url: http://x:1\ntokn: cvk_x\n"), 0o600))
	missing := filepath.Join(dir, "missing.yaml")

	for name, tc := range map[string]struct {
		args   []string
		env    map[string]string
		code   int
		stderr string
	}{
		"--config missing": {args: []string{"get", "x", "--config", missing}, code: 2,
			stderr: "conveyor: config file: open " + missing + ": no such file or directory\nRun 'conveyor get --help' for usage.\n"},
		"unknown config key": {args: []string{"get", "x", "--config", typo}, code: 2,
			stderr: "conveyor: config file " + typo + ": line 2: unknown key \"tokn\" (the keys are url and token)\nRun 'conveyor get --help' for usage.\n"},
		"not found": {args: []string{"get", "0193a2b4-0000-7000-8000-00000000000f"}, code: 1,
			stderr: "conveyor: no task 0193a2b4-0000-7000-8000-00000000000f (HTTP 404)\n"},
		"invalid":       {args: []string{"submit", "demo.sleep", "--priority", "12"}, code: 1, stderr: "conveyor: priority: must be an integer from 0 to 9 (HTTP 422)\n"},
		"conflict":      {args: []string{"cancel", "x"}, code: 1, stderr: "conveyor: task is COMPLETED: it cannot be cancelled (HTTP 409)\n"},
		"forbidden":     {args: []string{"keys", "ls"}, code: 1, stderr: "conveyor: needs the admin role (HTTP 403)\n"},
		"not a problem": {args: []string{"whoami"}, code: 1, stderr: "conveyor: Bad Gateway (HTTP 502)\n"},
		"unreachable": {args: []string{"get", "x"}, env: map[string]string{"CONVEYOR_URL": "http://127.0.0.1:1"}, code: 1,
			stderr: "conveyor: cannot reach the API at http://127.0.0.1:1: dial tcp 127.0.0.1:1: connect: connection refused\n" +
				"conveyor: is the API running at that address? --url, CONVEYOR_URL or url: in the config file names another\n"},
		"bad url": {args: []string{"get", "x"}, env: map[string]string{"CONVEYOR_URL": "localhost:8080"}, code: 2,
			stderr: "conveyor: API URL \"localhost:8080\": want http(s)://host[:port]\nRun 'conveyor get --help' for usage.\n"},
		"unknown command":  {args: []string{"sbumit"}, code: 2, stderr: "conveyor: unknown command \"sbumit\" for \"conveyor\"\n\nDid you mean this?\n\tsubmit\n\nRun 'conveyor --help' for usage.\n"},
		"unknown flag":     {args: []string{"ls", "--colour"}, code: 2, stderr: "conveyor: unknown flag: --colour\nRun 'conveyor ls --help' for usage.\n"},
		"missing argument": {args: []string{"get"}, code: 2, stderr: "conveyor: get wants ID, got 0 arguments\nRun 'conveyor get --help' for usage.\n"},
		"required flag":    {args: []string{"keys", "create", "ci"}, code: 2, stderr: "conveyor: required flag(s) \"role\" not set\nRun 'conveyor keys create --help' for usage.\n"},
		"bad payload": {args: []string{"submit", "demo.sleep", "-p", "{steps:1}"}, code: 2,
			stderr: "conveyor: the payload (--payload) is not valid JSON\nRun 'conveyor submit --help' for usage.\n"},
		"payload not an object": {args: []string{"submit", "demo.sleep", "-p", "[1]"}, code: 2,
			stderr: "conveyor: the payload (--payload) must be a JSON object, {…}\nRun 'conveyor submit --help' for usage.\n"},
		"two payloads": {args: []string{"submit", "demo.sleep", "-p", "{}", "-f", "x"}, code: 2,
			stderr: "conveyor: if any flags in the group [payload payload-file] are set none of the others can be; [payload payload-file] were all set\nRun 'conveyor submit --help' for usage.\n"},
		"bad output": {args: []string{"ls", "-o", "yaml"}, code: 2, stderr: "conveyor: --output must be text or json, not \"yaml\"\nRun 'conveyor ls --help' for usage.\n"},
		"events without id": {args: []string{"events"}, code: 2,
			stderr: "conveyor: events wants a task ID, or --follow for the org's live events\nRun 'conveyor events --help' for usage.\n"},
		"events --all with --follow": {args: []string{"events", "x", "--follow", "--all"}, code: 2,
			stderr: "conveyor: --limit, --cursor and --all are for a task's history, not with --follow\nRun 'conveyor events --help' for usage.\n"},
		"bad time": {args: []string{"ls", "--created-after", "yesterday"}, code: 2,
			stderr: "conveyor: --created-after \"yesterday\" is neither an RFC 3339 time such as 2026-01-02T15:04:05Z nor a duration back from now such as 1h or 30m\nRun 'conveyor ls --help' for usage.\n"},
		"negative duration": {args: []string{"cancel", "--all", "--created-before", "-1h", "--yes"}, code: 2,
			stderr: "conveyor: --created-before \"-1h\" is neither an RFC 3339 time such as 2026-01-02T15:04:05Z nor a duration back from now such as 1h or 30m\nRun 'conveyor cancel --help' for usage.\n"},
		"run-at JSON cannot carry": {args: []string{"submit", "demo.noop", "--run-at", "0000-01-01T00:00:00+24:00"}, code: 2,
			stderr: "conveyor: --run-at: \"0000-01-01T00:00:00+24:00\" is not a time the API takes: its offset from UTC must be under 24 hours\nRun 'conveyor submit --help' for usage.\n"},
		// The zero time would be sent as no bound at all: every task.
		"zero time": {args: []string{"cancel", "--all", "--created-before", "0001-01-01T00:00:00Z", "--yes"}, code: 2,
			stderr: "conveyor: --created-before must be later than 0001-01-01T00:00:00Z, got \"0001-01-01T00:00:00Z\"\nRun 'conveyor cancel --help' for usage.\n"},
		"--all with an id": {args: []string{"cancel", "--all", "x"}, code: 2,
			stderr: "conveyor: cancel --all takes no task ID (the filter flags choose the tasks), got [\"x\"]\nRun 'conveyor cancel --help' for usage.\n"},
		"filter without --all": {args: []string{"retry", "x", "--type", "demo.sleep"}, code: 2,
			stderr: "conveyor: --type goes with --all\nRun 'conveyor retry --help' for usage.\n"},
		"--yes without --all": {args: []string{"cancel", "x", "--yes"}, code: 2,
			stderr: "conveyor: --yes goes with --all\nRun 'conveyor cancel --help' for usage.\n"},
		"cancel without id": {args: []string{"cancel"}, code: 2,
			stderr: "conveyor: cancel wants a task ID, or --all and filter flags; got 0 arguments\nRun 'conveyor cancel --help' for usage.\n"},
		"no terminal to ask": {args: []string{"retry", "--all", "--type", "demo.sleep"}, code: 2,
			stderr: "conveyor: retry --all asks for a confirmation, and standard input is not a terminal: give --yes to retry without asking (--dry-run counts)\nRun 'conveyor retry --help' for usage.\n"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			c := newCLI(t, api)
			for k, v := range tc.env {
				c.env[k] = v
			}
			r := c.run(tc.args...)
			require.Equal(t, tc.stderr, r.stderr)
			require.Equal(t, tc.code, r.code)
			require.Empty(t, r.stdout)
		})
	}
}

// A refused credential says where a key is given.
func TestUnauthorizedSaysHowToGiveAKey(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.problem("GET /v1/whoami", 401, "missing bearer token")
	c := newCLI(t, api)
	delete(c.env, "CONVEYOR_TOKEN")
	r := c.run("whoami")
	require.Equal(t, 1, r.code)
	require.Equal(t, "conveyor: missing bearer token (HTTP 401)\n"+
		"conveyor: give an API key with --token, CONVEYOR_TOKEN (or CONVEYOR_KEY), or token: in the config file\n", r.stderr)
	require.Empty(t, api.recorded()[0].Auth)
}

func streamEvent(id int, task, status, state string, progress int, extra string) string {
	return fmt.Sprintf(`{"id":%d,"task_id":%q,"type":"demo.sleep","status":%q,"state":%q,"progress":%d,"actor":"WORKER",%s"created_at":"2026-11-23T12:00:0%d.5Z"}`,
		id, task, status, state, progress, extra, id)
}

// Off a terminal, watch prints a line per event and exits 0 only when
// every task COMPLETED.
func TestWatchPrintsLines(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.stream("ok",
		streamEvent(1, "ok", "PENDING", "Queued", 0, ""),
		streamEvent(2, "ok", "IN_PROGRESS", "Step 1/2", 50, ""),
		streamEvent(3, "ok", "COMPLETED", "Completed", 100, `"result":{"slept_ms":400},`))
	api.stream("bad",
		streamEvent(4, "bad", "PENDING", "Queued", 0, ""),
		streamEvent(5, "bad", "FAILED", "Failed", 0, `"error":"demo.sleep: failing attempt 1",`))
	c := newCLI(t, api)

	r := c.run("watch", "ok")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `2026-11-23T12:00:01.500Z  ok  PENDING       0%  Queued
2026-11-23T12:00:02.500Z  ok  IN_PROGRESS  50%  Step 1/2
2026-11-23T12:00:03.500Z  ok  COMPLETED   100%  Completed
`, r.stdout)

	r = c.run("watch", "bad")
	require.Equal(t, 1, r.code)
	require.Empty(t, r.stderr, "the failure is on the screen")
	require.Equal(t, `2026-11-23T12:00:04.500Z  bad  PENDING       0%  Queued
2026-11-23T12:00:05.500Z  bad  FAILED        0%  Failed: demo.sleep: failing attempt 1
`, r.stdout)

	// Both at once: each task's lines in order, exit 1 for the failed one.
	r = c.run("watch", "ok", "bad")
	require.Equal(t, 1, r.code)
	require.Equal(t, 5, strings.Count(r.stdout, "\n"))

	// A task that cannot be followed is an error, and exit 1.
	api.problem("GET /v1/tasks/gone/stream", 404, "no task gone")
	r = c.run("watch", "ok", "gone")
	require.Equal(t, 1, r.code)
	require.Equal(t, "conveyor: task gone: no task gone (HTTP 404)\n", r.stderr)

	// JSON lines: each event as the API sent it.
	r = c.run("watch", "ok", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	require.Len(t, lines, 3)
	require.JSONEq(t, streamEvent(3, "ok", "COMPLETED", "Completed", 100, `"result":{"slept_ms":400},`), lines[2])
}

// An error of several lines (errors.Join writes one per error), or a state
// with a control character, still makes one line per event: the lines of
// watch and events --follow are read line by line, by people and grep.
func TestWatchLinesKeepOneLinePerEvent(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.stream("multi",
		streamEvent(1, "multi", "IN_PROGRESS", "Reading\r\nin.csv\tnow", 10, ""),
		streamEvent(2, "multi", "FAILED", "Failed", 10, `"error":"step 3: open in.csv: no such file\n\u001b[2Jstep 4: not run",`))
	r := newCLI(t, api).run("watch", "multi")
	require.Equal(t, 1, r.code)
	require.Equal(t, `2026-11-23T12:00:01.500Z  multi  IN_PROGRESS  10%  Reading  in.csv now
2026-11-23T12:00:02.500Z  multi  FAILED       10%  Failed: step 3: open in.csv: no such file  [2Jstep 4: not run
`, r.stdout)
}

func TestSubmitWait(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("POST /v1/tasks", 201, `{"id":"w1","type":"demo.sleep","status":"PENDING","created_at":"2026-11-23T12:00:00Z"}`)
	api.stream("w1",
		streamEvent(1, "w1", "PENDING", "Queued", 0, ""),
		streamEvent(2, "w1", "CANCELLED", "Cancelled", 0, ""))
	r := newCLI(t, api).run("submit", "demo.sleep", "--wait")
	require.Equal(t, 1, r.code, "CANCELLED is not COMPLETED")
	require.Equal(t, `w1
2026-11-23T12:00:01.500Z  w1  PENDING       0%  Queued
2026-11-23T12:00:02.500Z  w1  CANCELLED     0%  Cancelled
`, r.stdout)
}

// events --follow without an ID prints the org's feed until interrupted,
// which ends it normally.
func TestEventsFollowTheOrgFeed(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.mux.HandleFunc("GET /v1/events/stream", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprintf(w, "retry: 2000\n\n")
		fmt.Fprintf(w, "id: 7\nevent: task\ndata: %s\n\n", streamEvent(7, "a", "FAILED", "Failed", 20, `"error":"boom",`))
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := &testenv.SyncBuffer{}
	done := make(chan result)
	c := newCLI(t, api)
	go func() { done <- c.runContext(ctx, out, "events", "--follow", "--type", "demo.sleep", "-s", "failed") }()
	require.Eventually(t, func() bool { return strings.Contains(out.String(), "\n") }, 10*time.Second, 10*time.Millisecond)
	cancel()
	r := <-done
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "2026-11-23T12:00:07.500Z  a  demo.sleep  FAILED       20%  Failed: boom\n", r.stdout)
	require.Equal(t, "status=FAILED&type=demo.sleep", api.recorded()[0].Query)
}

func TestKeys(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("POST /v1/keys", 201, `{"id":"k2","name":"billing","role":"writer","prefix":"cvk_abcdefghijklmnop","org_roles":["finance"],"created_at":"2026-11-23T12:00:00Z","secret":"cvk_abcdefghijklmnop_secret"}`)
	api.json("GET /v1/keys", 200, `{"keys":[
		{"id":"k2","name":"billing","role":"writer","prefix":"cvk_abcdefghijklmnop","org_roles":["finance","ops"],"created_at":"2026-11-23T12:00:00Z","expires_at":"2026-12-23T12:00:00Z"},
		{"id":"k1","name":"make run","role":"admin","prefix":"cvk_qrstuvwxyz234567","org_roles":[],"created_at":"2026-11-22T12:00:00Z","last_used_at":"2026-11-23T11:59:59Z","revoked_at":"2026-11-23T11:00:00Z"}]}`)
	api.json("DELETE /v1/keys/{id}", 200, `{"id":"k2","name":"billing","role":"writer","prefix":"cvk_abcdefghijklmnop","org_roles":[],"created_at":"2026-11-23T12:00:00Z","revoked_at":"2026-11-23T12:00:01Z"}`)
	c := newCLI(t, api)

	r := c.run("keys", "create", "billing", "--role", "writer", "--org-role", "finance", "--expires-in", "720h")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "cvk_abcdefghijklmnop_secret\n", r.stdout, "the secret alone, for $(…)")
	require.Contains(t, r.stderr, "made key k2 (cvk_abcdefghijklmnop, role writer)")
	require.JSONEq(t, `{"name":"billing","role":"writer","org_roles":["finance"],"expires_at":"2026-12-23T12:00:00Z"}`, api.recorded()[0].Body)

	r = c.run("keys", "ls")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `ID  NAME      ROLE    PREFIX                ORG ROLES    CREATED                   LAST USED                 STATE
k2  billing   writer  cvk_abcdefghijklmnop  finance,ops  2026-11-23T12:00:00.000Z                            expires 2026-12-23T12:00:00.000Z
k1  make run  admin   cvk_qrstuvwxyz234567               2026-11-22T12:00:00.000Z  2026-11-23T11:59:59.000Z  revoked 2026-11-23T11:00:00.000Z
`, r.stdout)

	r = c.run("keys", "revoke", "k2")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "revoked key k2 (billing, cvk_abcdefghijklmnop)\n", r.stdout)
}

func TestUsersAndRoles(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	user := `{"id":"u1","external_id":"auth0|1","email":"ana@example.com","role":"reader","org_roles":["finance"],"created_at":"2026-11-23T12:00:00Z"}`
	api.json("POST /v1/users", 201, user)
	api.json("GET /v1/users", 200, `{"users":[`+user+`]}`)
	api.json("PATCH /v1/users/{id}", 200, strings.Replace(user, "reader", "writer", 1))
	api.mux.HandleFunc("DELETE /v1/users/{id}", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	api.json("POST /v1/roles", 201, `{"id":"r1","slug":"finance","name":"Finance","created_at":"2026-11-23T12:00:00Z"}`)
	api.json("GET /v1/roles/{slug}/members", 200, `{"members":[`+user+`]}`)
	api.mux.HandleFunc("PUT /v1/roles/{slug}/members/{user}", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	api.mux.HandleFunc("DELETE /v1/roles/{slug}/members/{user}", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	c := newCLI(t, api)

	for _, step := range []struct {
		args []string
		out  string
	}{
		{[]string{"users", "create", "auth0|1", "--role", "reader", "--email", "ana@example.com"}, "u1\n"},
		{[]string{"users", "ls"}, "ID  EXTERNAL ID  EMAIL            ROLE    ORG ROLES  CREATED\nu1  auth0|1      ana@example.com  reader  finance    2026-11-23T12:00:00.000Z\n"},
		{[]string{"users", "update", "u1", "--role", "writer"}, "user u1 (auth0|1) is now writer\n"},
		{[]string{"users", "delete", "u1"}, "deleted user u1\n"},
		{[]string{"roles", "create", "finance", "--name", "Finance"}, "finance\n"},
		{[]string{"roles", "add-member", "finance", "u1"}, "user u1 is a member of finance\n"},
		{[]string{"roles", "members", "finance"}, "ID  EXTERNAL ID  EMAIL            ROLE    ORG ROLES  CREATED\nu1  auth0|1      ana@example.com  reader  finance    2026-11-23T12:00:00.000Z\n"},
		// Said as done, not as the state it was already in.
		{[]string{"roles", "remove-member", "finance", "u1"}, "user u1 is not a member of finance now\n"},
	} {
		r := c.run(step.args...)
		require.Equal(t, 0, r.code, "%v: %s", step.args, r.stderr)
		require.Equal(t, step.out, r.stdout, "%v", step.args)
	}
	var calls []string
	for _, req := range api.recorded() {
		calls = append(calls, req.Method+" "+req.Path+" "+req.Body)
	}
	require.Equal(t, []string{
		`POST /v1/users {"external_id":"auth0|1","email":"ana@example.com","role":"reader"}`,
		"GET /v1/users ",
		`PATCH /v1/users/u1 {"role":"writer"}`,
		"DELETE /v1/users/u1 ",
		`POST /v1/roles {"name":"Finance","slug":"finance"}`,
		"PUT /v1/roles/finance/members/u1 ",
		"GET /v1/roles/finance/members ",
		"DELETE /v1/roles/finance/members/u1 ",
	}, calls)
}

// The API pages keys, users and members; the listing commands follow
// next_cursor, so that they still show every one, as a table and as JSON.
func TestAdminListingsFollowTheCursor(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	paged := func(field string, ids ...string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			item := func(id string) string {
				return `{"id":"` + id + `","name":"n","external_id":"x","role":"reader","org_roles":[],"created_at":"2026-11-23T12:00:00Z"}`
			}
			if r.URL.Query().Get("cursor") == "" {
				fmt.Fprintf(w, `{"%s":[%s],"next_cursor":"c1"}`, field, item(ids[0]))
				return
			}
			fmt.Fprintf(w, `{"%s":[%s]}`, field, item(ids[1]))
		}
	}
	api.mux.HandleFunc("GET /v1/keys", paged("keys", "k1", "k2"))
	api.mux.HandleFunc("GET /v1/users", paged("users", "u1", "u2"))
	api.mux.HandleFunc("GET /v1/roles/{slug}/members", paged("members", "m1", "m2"))
	c := newCLI(t, api)

	for _, l := range []struct {
		args  []string
		field string
		ids   []string
	}{
		{[]string{"keys", "ls"}, "keys", []string{"k1", "k2"}},
		{[]string{"users", "ls"}, "users", []string{"u1", "u2"}},
		{[]string{"roles", "members", "ops"}, "members", []string{"m1", "m2"}},
	} {
		r := c.run(l.args...)
		require.Equal(t, 0, r.code, "%v: %s", l.args, r.stderr)
		for _, id := range l.ids {
			require.Contains(t, r.stdout, "\n"+id+" ", "%v: %s", l.args, r.stdout)
		}
		r = c.run(append(l.args, "-o", "json")...)
		require.Equal(t, 0, r.code, "%v: %s", l.args, r.stderr)
		var out map[string][]struct{ ID string }
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &out), r.stdout)
		require.Len(t, out[l.field], 2, "%v: %s", l.args, r.stdout)
		require.Equal(t, l.ids[1], out[l.field][1].ID)
	}
}

func TestVersionAndCompletion(t *testing.T) {
	t.Parallel()
	c := newCLI(t, nil)
	r := c.run("--version")
	require.Equal(t, 0, r.code)
	require.Equal(t, "conveyor "+buildVersion()+"\n", r.stdout)

	for _, shell := range []string{"bash", "zsh", "fish", "powershell"} {
		r := c.run("completion", shell)
		require.Equal(t, 0, r.code, r.stderr)
		require.Contains(t, r.stdout, "conveyor", shell)
	}
	// The dynamic completion of a flag's values.
	r = c.run("__complete", "ls", "--status", "")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "IN_PROGRESS\n")
}

// A command that only groups others (keys, users, roles) refuses a
// subcommand it does not have, as the root does: a misspelt `keys crate`
// is a command used wrongly (exit 2), not its help and exit 0.
func TestGroupCommandsRefuseAnUnknownSubcommand(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	for _, args := range [][]string{
		{"keys", "crate", "ci"},
		{"users", "lst"},
		{"roles", "add-membr", "finance", "u1"},
	} {
		r := newCLI(t, api).run(args...)
		require.Equal(t, 2, r.code, "%v: %s", args, r.stdout)
		require.Contains(t, r.stderr, fmt.Sprintf("conveyor: unknown command %q for \"conveyor %s\"", args[1], args[0]), "%v", args)
		require.Empty(t, r.stdout, "%v", args)
	}
	require.Empty(t, api.recorded())

	// Alone, such a command shows its help.
	r := newCLI(t, api).run("keys")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "Available Commands:")
}

// cobra's own commands refuse what they do not know, as the others do: a
// misspelt shell is not the usage on standard output, which would be
// redirected into the completion file, with exit 0.
func TestBuiltinCommandsRefuseAnUnknownArgument(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		says string
	}{
		{[]string{"completion", "zhs"}, `unknown command "zhs" for "conveyor completion"`},
		{[]string{"help", "sumbit"}, `unknown help topic "sumbit"`},
	} {
		r := newCLI(t, nil).run(c.args...)
		require.Equal(t, 2, r.code, "%v: %s", c.args, r.stdout)
		require.Contains(t, r.stderr, c.says, "%v", c.args)
		require.Empty(t, r.stdout, "%v", c.args)
	}
	// What they know still works.
	r := newCLI(t, nil).run("help", "submit")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "conveyor submit TYPE")
	r = newCLI(t, nil).run("completion")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "Available Commands:")
}

// A page size out of its range is a command used wrongly, as runs --limit
// says, not silently the API's default page.
func TestListLimitOutOfRange(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/tasks", 200, `{"tasks":[]}`)
	api.json("GET /v1/tasks/{id}/events", 200, `{"events":[]}`)
	for _, args := range [][]string{
		{"ls", "--limit", "-1"},
		{"ls", "-n", "0"},
		{"events", "x", "--limit", "-5"},
	} {
		r := newCLI(t, api).run(args...)
		require.Equal(t, 2, r.code, "%v: %s", args, r.stdout)
		require.Contains(t, r.stderr, "--limit must be", "%v", args)
	}
	require.Empty(t, api.recorded(), "nothing asked of the API")
}

// runs --limit 0 is out of the range its help gives (1 to 200), as ls -n 0
// is: a command used wrongly, not silently the API's default page of 50.
func TestRunsLimitOutOfRange(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/runs", 200, `{"runs":[]}`)
	for _, args := range [][]string{
		{"runs", "--limit", "0"},
		{"runs", "ls", "-n", "0"},
		{"runs", "-n", "201"},
	} {
		r := newCLI(t, api).run(args...)
		require.Equal(t, 2, r.code, "%v: %s", args, r.stdout)
		require.Contains(t, r.stderr, "--limit must be between 1 and 200", "%v", args)
	}
	require.Empty(t, api.recorded(), "nothing asked of the API")
}

// A flag that would be ignored or would bound nothing is refused before
// any request: a timeout of 0 or less, an interval without --wait.
func TestFlagsThatWouldDoNothingAreRefused(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/runs", 200, `{"runs":[]}`)
	for _, c := range []struct {
		args []string
		says string
	}{
		{[]string{"runs", "--timeout", "-1s"}, "--timeout must be positive"},
		{[]string{"runs", "--timeout", "0s"}, "--timeout must be positive"},
		{[]string{"runs", "start", "etl", "--interval", "2s"}, "--interval applies only with --wait"},
		{[]string{"keys", "create", "ci", "--role", "writer", "--expires-in", "0s"}, "--expires-in must be positive, got 0s"},
	} {
		r := newCLI(t, api).run(c.args...)
		require.Equal(t, 2, r.code, "%v: %s", c.args, r.stdout)
		require.Contains(t, r.stderr, c.says, "%v", c.args)
	}
	require.Empty(t, api.recorded(), "nothing asked of the API")
}

// get writes one "key: value" line per field, whatever the task's text
// holds: an error of several lines (errors.Join) or a state with an
// escape sequence neither breaks the lines nor reaches the terminal.
func TestGetKeepsOneLinePerField(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/tasks/{id}", 200, `{"id":"t1","type":"demo.sleep","status":"FAILED","state":"Step\t2\u001b[2J\u202egnp.exe","progress":40,
		"attempt":1,"max_attempts":1,"error":"step 3: boom\nstep 4:\u2028not run","created_at":"2026-11-23T11:58:00Z"}`)
	r := newCLI(t, api).run("get", "t1")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `id:       t1
type:     demo.sleep
status:   FAILED
progress: 40%
state:    Step 2 [2Jgnp.exe
error:    step 3: boom step 4: not run
attempt:  1 of 1
priority: 0
created:  2026-11-23T11:58:00.000Z
`, r.stdout)
}

// Below the bars, the error of a task that failed is written whole, but
// on its line: an escape sequence in it is not sent to the terminal, and
// a line of it does not read as a line of its own.
func TestBarViewWritesAFailedTasksErrorOnItsLine(t *testing.T) {
	t.Parallel()
	var out testenv.SyncBuffer
	v := newBarView(&out, []string{"t1"}, func() time.Time { return testNow })
	v.event(0, apiclient.Event{ID: 1, TaskID: "t1", Type: "demo.sleep", Status: apiclient.StatusFailed,
		Error: "step 3: boom\n\x1b[2Jstep 4: not run", CreatedAt: testNow})
	v.end(0, taskEnd{status: apiclient.StatusFailed, taskErr: "step 3: boom\n\x1b[2Jstep 4: not run"})
	v.close()
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	require.Equal(t, "t1 FAILED: step 3: boom  [2Jstep 4: not run", lines[len(lines)-1])
	require.NotContains(t, out.String(), "\x1b[2J")
}

// An API that takes longer than --timeout to answer was reached: the error
// says it did not answer in time, not that it cannot be reached (which
// sends people to look for a network fault).
func TestSlowAPIIsNotUnreachable(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.mux.HandleFunc("GET /v1/tasks/{id}", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	})
	r := newCLI(t, api).run("get", "x", "--timeout", "50ms")
	require.Equal(t, 1, r.code)
	require.Equal(t, "conveyor: the API at "+api.srv.URL+" did not answer within 50ms\n", r.stderr)
}

// A submission answered with the task of its idempotency key says so:
// --no-dedupe, which the note about duplicates of the same input offers,
// would not submit it again (and may have been given).
func TestSubmitIdempotencyKeyReused(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("POST /v1/tasks", 200, `{"id":"old-id","type":"demo.sleep","status":"PENDING","created_at":"2026-11-23T12:00:00Z"}`)
	r := newCLI(t, api).run("submit", "demo.sleep", "-p", `{"steps":1}`, "-k", "order-42", "--no-dedupe")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "old-id\n", r.stdout)
	require.Equal(t, "conveyor: the idempotency key order-42 is task old-id's (PENDING), which is not submitted again\n", r.stderr)
}

// submit sends neither a priority nor a number of attempts unless given,
// so the API's defaults apply: its help names those, not defaults of its
// own that it never sends.
func TestSubmitHelpClaimsNoDefaultsItDoesNotSend(t *testing.T) {
	t.Parallel()
	res := newCLI(t, nil).run("submit", "--help")
	require.Zero(t, res.code, res.stderr)
	for _, line := range strings.Split(res.stdout, "\n") {
		if f := strings.Fields(line); len(f) > 0 && (f[0] == "--priority" || f[0] == "--max-attempts") {
			require.NotContains(t, line, "(default", "a default the command does not send: %s", line)
			require.Contains(t, line, "the API's")
		}
	}
}

// A state or a type in wide characters (CJK, emoji) takes two columns a
// character on a terminal: the table's columns stay aligned by the width
// shown, not by the count of characters.
func TestListAlignsWideCharacters(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/tasks", 200, `{"tasks":[
		{"id":"t2","type":"画像.変換","status":"IN_PROGRESS","state":"処理中 2/5","progress":40,"created_at":"2026-11-23T11:59:15Z","updated_at":"2026-11-23T11:59:58Z"},
		{"id":"t1","type":"demo.sleep","status":"PENDING","state":"Queued","progress":0,"created_at":"2026-11-23T11:00:00Z","updated_at":"2026-11-23T11:00:00Z"}
	]}`)
	r := newCLI(t, api).run("ls")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `ID  TYPE        STATUS       PROGRESS  STATE       AGE  UPDATED
t2  画像.変換   IN_PROGRESS  40%       処理中 2/5  45s  2s
t1  demo.sleep  PENDING      0%        Queued      1h   1h
`, r.stdout)
}

// A 429's detail points at the Retry-After header, which the person at
// the command line does not see: the wait it asks for is printed.
func TestRateLimitedSaysWhenToRetry(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.mux.HandleFunc("GET /v1/tasks/{id}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.Header().Set("Retry-After", "7")
		w.WriteHeader(http.StatusTooManyRequests)
		fmt.Fprintf(w, `{"type":"urn:conveyor:problem:rate-limited","title":"Too Many Requests","status":429,"detail":"too many requests for this key; retry after the Retry-After header's seconds"}`)
	})
	r := newCLI(t, api).run("get", "x")
	require.Equal(t, 1, r.code)
	require.Empty(t, r.stdout)
	require.Equal(t, "conveyor: too many requests for this key; retry after the Retry-After header's seconds (HTTP 429)\n"+
		"conveyor: the API asks to retry after 7s\n", r.stderr)
}

// watch, whose tasks' streams a refused credential ends, says where a key
// is given, as every other command does.
func TestWatchUnauthorizedSaysHowToGiveAKey(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.problem("GET /v1/tasks/{id}/stream", 401, "missing bearer token")
	c := newCLI(t, api)
	delete(c.env, "CONVEYOR_TOKEN")
	r := c.run("watch", "a", "b")
	require.Equal(t, 1, r.code)
	require.Equal(t, "conveyor: task a: missing bearer token (HTTP 401)\n"+
		"conveyor: task b: missing bearer token (HTTP 401)\n"+
		"conveyor: give an API key with --token, CONVEYOR_TOKEN (or CONVEYOR_KEY), or token: in the config file\n", r.stderr)
}

// watch at an address where no API listens says so at once, and where the
// address comes from, as get does: it has no stream to resume.
func TestWatchUnreachableSaysWhereTheAddressComesFrom(t *testing.T) {
	t.Parallel()
	c := newCLI(t, nil)
	c.env["CONVEYOR_URL"] = "http://127.0.0.1:1"
	r := c.run("watch", "a")
	require.Equal(t, 1, r.code)
	require.Equal(t, "conveyor: task a: cannot reach the API at http://127.0.0.1:1: dial tcp 127.0.0.1:1: connect: connection refused\n"+
		"conveyor: is the API running at that address? --url, CONVEYOR_URL or url: in the config file names another\n", r.stderr)
}

// A payload or a jobs file read from a pipe that stays open does not keep
// the command waiting once interrupted: Ctrl-C, which the command catches,
// ends it (130), and nothing is sent.
func TestReadingStandardInputInterrupted(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	for _, args := range [][]string{
		{"submit", "demo.sleep"},
		{"submit", "demo.sleep", "--payload-file", "-"},
		{"jobs", "trigger", "nightly", "-f", "-"},
		{"apply", "-f", "-"},
	} {
		c := newCLI(t, api)
		stdin, writer := io.Pipe()
		t.Cleanup(func() { _ = writer.Close() })
		waiting := &firstRead{r: stdin, reading: make(chan struct{})}
		c.stdin = waiting

		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan result)
		go func() { done <- c.runContext(ctx, &testenv.SyncBuffer{}, args...) }()
		select {
		case <-waiting.reading:
		case <-time.After(10 * time.Second):
			t.Fatalf("%v: standard input was not read", args)
		}
		cancel()
		select {
		case r := <-done:
			require.Equal(t, 130, r.code, "%v: %s", args, r.stderr)
		case <-time.After(10 * time.Second):
			t.Fatalf("%v: still reading standard input after the interrupt", args)
		}
	}
	require.Empty(t, api.recorded())
}

// A key's name and a user's external id are the org's text; the lines that
// confirm a revoke or a role change strip escape sequences from them as the
// tables do.
func TestAdminConfirmationsStripControlCharacters(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("DELETE /v1/keys/{id}", 200, `{"id":"k2","name":"bill\u001b[2Jing","role":"writer","prefix":"cvk_abcdefghijklmnop","org_roles":[],"created_at":"2026-11-23T12:00:00Z","revoked_at":"2026-11-23T12:00:01Z"}`)
	api.json("PATCH /v1/users/{id}", 200, `{"id":"u1","external_id":"auth0|1\u001b]0;pwned\u0007\n","email":"ana@example.com","role":"writer","org_roles":[],"created_at":"2026-11-23T12:00:00Z"}`)
	c := newCLI(t, api)

	r := c.run("keys", "revoke", "k2")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "revoked key k2 (bill [2Jing, cvk_abcdefghijklmnop)\n", r.stdout)

	r = c.run("users", "update", "u1", "--role", "writer")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "user u1 (auth0|1 ]0;pwned  ) is now writer\n", r.stdout)
}

// An API that answers the cursor it was sent would have ls --all and
// events --all read forever; they stop with an error, as the admin listings
// do. (This fake gives up after a few pages, so that a loop ends.)
func TestAllStopsWhenTheAPIRepeatsTheCursor(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	repeat := func(field string) http.HandlerFunc {
		var mu sync.Mutex
		pages := 0
		return func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			mu.Lock()
			pages++
			last := pages > 5
			mu.Unlock()
			next := "c1"
			if last {
				next = ""
			}
			fmt.Fprintf(w, `{%q:[],"next_cursor":%q}`, field, next)
		}
	}
	api.mux.HandleFunc("GET /v1/tasks", repeat("tasks"))
	api.mux.HandleFunc("GET /v1/tasks/{id}/events", repeat("events"))
	c := newCLI(t, api)

	r := c.run("ls", "--all")
	require.Equal(t, exitFailure, r.code, r.stdout)
	require.Contains(t, r.stderr, "the API answered the cursor it was sent")
	r = c.run("events", "a", "--all")
	require.Equal(t, exitFailure, r.code, r.stdout)
	require.Contains(t, r.stderr, "the API answered the cursor it was sent")
	require.Len(t, api.recorded(), 4, "two pages each")
}
