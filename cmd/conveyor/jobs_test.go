package main

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// writeFile writes a file in a directory of the test's own and returns
// its path.
func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	require.NoError(t, os.WriteFile(path, []byte(content), 0o600))
	return path
}

const goodJobsFile = `jobs:
  - name: nightly-report
    type: reports.build
    source:
      kind: cron
      schedule: "0 2 * * *"
      timezone: Europe/Paris
  - name: sync
    type: crm.sync
types:
  - type: emails.send
    max_concurrency: 10
`

// A file with mistakes is checked here: each mistake on a line of its own,
// FILE:LINE:COLUMN first, and the API is not called.
func TestApplyBadFileIsNotSent(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	path := writeFile(t, "jobs.yaml", `jobs:
  - name: nightly-report
    type: reports.build
    source:
      kind: cron
      schedule: "0 25 * * *"
  - name: Sync
    type: crm.sync
    priority: 12
types:
  - type: emails.send
    max_concurrency: 0
`)
	r := newCLI(t, api).run("apply", "-f", path)
	require.Equal(t, 1, r.code)
	require.Empty(t, r.stdout)
	require.Equal(t, path+`:6:17: jobs[0].source.schedule: invalid schedule "0 25 * * *": end of range (25) above maximum (23): 25
`+path+`:7:11: jobs[1].name: invalid name "Sync": use 1 to 128 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit
`+path+`:9:15: jobs[1].priority: priority must be between 0 and 9, got 12
`+path+`:12:22: types[0].max_concurrency: max_concurrency must be between 1 and 10000, got 0 (leave it out for no limit)
conveyor: `+path+` has 4 mistakes; nothing was sent
`, r.stderr)
	require.Empty(t, api.recorded(), "nothing reaches the API")

	// Standard input is named as such; a syntax error has a line only.
	c := newCLI(t, api)
	c.stdin = strings.NewReader("jobs: [\n")
	r = c.run("apply", "-f", "-", "--dry-run")
	require.Equal(t, 1, r.code)
	require.Equal(t, "<stdin>:1: invalid YAML: did not find expected node content\nconveyor: <stdin> has 1 mistake; nothing was sent\n", r.stderr)
	require.Empty(t, api.recorded())
}

// The file goes as it is, YAML, and the changes come back as a diff and a
// count.
func TestApplyPrintsTheDiff(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	changes := `{"dry_run":false,"changes":[
		{"op":"create","kind":"job","name":"nightly-report","fields":[{"field":"type","old":"","new":"reports.build"},
			{"field":"source.kind","old":"","new":"cron"},{"field":"source.schedule","old":"","new":"0 2 * * *"},
			{"field":"source.timezone","old":"","new":"Europe/Paris"}]},
		{"op":"update","kind":"job","name":"sync","fields":[{"field":"priority","old":"5","new":"7"},
			{"field":"max_concurrency","old":"","new":"2"}]},
		{"op":"unchanged","kind":"job","name":"weekly"},
		{"op":"delete","kind":"job","name":"old-thing"},
		{"op":"unchanged","kind":"type","name":"emails.send"}]}`
	api.json("POST /v1/jobs/apply", 200, changes)
	path := writeFile(t, "jobs.yaml", goodJobsFile)
	c := newCLI(t, api)

	r := c.run("apply", "-f", path, "--prune")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `+ job nightly-report (reports.build, cron "0 2 * * *" Europe/Paris)
~ job sync: priority 5 → 7, max_concurrency none → 2
= job weekly
- job old-thing
= type emails.send
1 created, 1 updated, 1 deleted, 2 unchanged
`, r.stdout)
	req := api.recorded()[0]
	require.Equal(t, "POST /v1/jobs/apply dry_run=false&prune=true application/yaml", req.Method+" "+req.Path+" "+req.Query+" "+req.ContentType)
	require.Equal(t, goodJobsFile, req.Body, "the file as written, so the API's lines are the file's")

	// -o json is the API's answer.
	r = c.run("apply", "-f", path, "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, changes, r.stdout)
	require.Equal(t, "dry_run=false&prune=false", api.recorded()[1].Query)
}

func TestApplySummary(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.mux.HandleFunc("POST /v1/jobs/apply", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		dry := r.URL.Query().Get("dry_run")
		switch r.URL.Query().Get("prune") {
		case "true": // the file changes nothing
			fmt.Fprintf(w, `{"dry_run":%s,"changes":[{"op":"unchanged","kind":"job","name":"a"},{"op":"unchanged","kind":"job","name":"b"}]}`, dry)
		default:
			fmt.Fprintf(w, `{"dry_run":%s,"changes":[{"op":"create","kind":"job","name":"a","fields":[{"field":"type","old":"","new":"t"}]},
				{"op":"update","kind":"job","name":"b","fields":[{"field":"active","old":"true","new":"false"}]},
				{"op":"unchanged","kind":"job","name":"c"},
				{"op":"create","kind":"type","name":"t","fields":[{"field":"max_concurrency","old":"","new":"3"}]}]}`, dry)
		}
	})
	path := writeFile(t, "jobs.yaml", goodJobsFile)
	c := newCLI(t, api)

	for _, tc := range []struct {
		args []string
		out  string
	}{
		{[]string{"--dry-run"}, `+ job a (t)
~ job b: active true → false
= job c
+ type t (max_concurrency 3)
(dry run) would create 2, update 1; 1 unchanged
`},
		{nil, "+ job a (t)\n~ job b: active true → false\n= job c\n+ type t (max_concurrency 3)\n2 created, 1 updated, 1 unchanged\n"},
		{[]string{"--dry-run", "--prune"}, "= job a\n= job b\n(dry run) nothing would change; 2 unchanged\n"},
		{[]string{"--prune"}, "= job a\n= job b\n2 unchanged\n"},
	} {
		r := c.run(append([]string{"apply", "-f", path}, tc.args...)...)
		require.Equal(t, 0, r.code, r.stderr)
		require.Equal(t, tc.out, r.stdout, "%v", tc.args)
	}
}

// When the API finds mistakes the local check did not (or a newer rule),
// they are shown the same way.
func TestApplyRefusedByTheAPI(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.mux.HandleFunc("POST /v1/jobs/apply", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusUnprocessableEntity)
		fmt.Fprintf(w, `{"type":"urn:conveyor:problem:invalid","title":"Unprocessable Entity","status":422,
			"detail":"the file has 2 mistake(s); nothing was applied","errors":[
			{"line":6,"column":17,"path":"jobs[0].source.schedule","message":"too frequent"},
			{"line":0,"column":0,"path":"","message":"too many jobs"}]}`)
	})
	c := newCLI(t, api)
	c.stdin = strings.NewReader(goodJobsFile)
	r := c.run("apply", "-f", "-")
	require.Equal(t, 1, r.code)
	require.Empty(t, r.stdout)
	require.Equal(t, "<stdin>:6:17: jobs[0].source.schedule: too frequent\n<stdin>: too many jobs\n"+
		"conveyor: <stdin> has 2 mistakes; nothing was applied\n", r.stderr)
	require.Equal(t, goodJobsFile, api.recorded()[0].Body)

	// Any other refusal is the API's message, as for every command.
	other := newFakeAPI(t)
	other.problem("POST /v1/jobs/apply", 403, "needs the admin role")
	r = newCLI(t, other).run("apply", "--file", writeFile(t, "jobs.json", `{"jobs":[]}`))
	require.Equal(t, 1, r.code)
	require.Equal(t, "conveyor: needs the admin role (HTTP 403)\n", r.stderr)
}

func TestApplyUsage(t *testing.T) {
	t.Parallel()
	c := newCLI(t, newFakeAPI(t))
	r := c.run("apply")
	require.Equal(t, 2, r.code)
	require.Equal(t, "conveyor: required flag(s) \"file\" not set\nRun 'conveyor apply --help' for usage.\n", r.stderr)
	r = c.run("apply", "-f", filepath.Join(t.TempDir(), "missing.yaml"))
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stderr, "conveyor: read the jobs file: open ")
}

const jobsJSON = `{"jobs":[
	{"id":"j1","name":"nightly-report","type":"reports.build","payload":{"format":"pdf"},"priority":7,
	 "source":{"kind":"cron","schedule":"0 2 * * *","timezone":"Europe/Paris","missed":"skip"},"max_attempts":10,
	 "timeout_seconds":600,"heartbeat_timeout_seconds":60,"max_concurrency":2,"max_concurrency_per_key":1,"active":true,
	 "config_hash":"abc123","paused":false,"next_tick_at":"2026-11-24T01:00:00Z","created_at":"2026-11-23T11:00:00Z",
	 "updated_at":"2026-11-23T11:30:00Z"},
	{"id":"j2","name":"sync","type":"crm.sync","payload":{},"priority":5,
	 "source":{"kind":"cron","schedule":"@every 30s","timezone":"UTC","missed":"run_once"},"max_attempts":3,"active":true,
	 "config_hash":"def","paused":false,"next_tick_at":"2026-11-23T12:00:12.4Z","created_at":"2026-11-23T11:00:00Z","updated_at":"2026-11-23T11:00:00Z"},
	{"id":"j3","name":"weekly","type":"reports.build","payload":{},"priority":5,
	 "source":{"kind":"cron","schedule":"@weekly","timezone":"UTC","missed":"run_once"},"max_attempts":3,"active":true,
	 "config_hash":"ghi","paused":true,"paused_at":"2026-11-23T11:50:00Z","created_at":"2026-11-23T11:00:00Z","updated_at":"2026-11-23T11:00:00Z"},
	{"id":"j4","name":"old","type":"crm.sync","payload":{},"priority":5,
	 "source":{"kind":"cron","schedule":"@daily","timezone":"UTC","missed":"run_once"},"max_attempts":3,"active":false,
	 "config_hash":"jkl","paused":false,"created_at":"2026-11-23T11:00:00Z","updated_at":"2026-11-23T11:00:00Z"},
	{"id":"j5","name":"on-demand","type":"emails.send","payload":{},"priority":5,"max_attempts":3,"active":true,
	 "config_hash":"mno","paused":false,"created_at":"2026-11-23T11:00:00Z","updated_at":"2026-11-23T11:00:00Z"}]}`

func TestJobs(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/jobs", 200, jobsJSON)
	one := jobsJSON[strings.Index(jobsJSON, `{"id":"j1"`):strings.Index(jobsJSON, `,
	{"id":"j2"`)]
	api.json("GET /v1/jobs/{name}", 200, one)
	api.json("POST /v1/jobs/{name}/pause", 200, strings.Replace(strings.Replace(one, `"paused":false`, `"paused":true,"paused_at":"2026-11-23T12:00:00Z"`, 1),
		`"next_tick_at":"2026-11-24T01:00:00Z",`, "", 1))
	api.json("POST /v1/jobs/{name}/resume", 200, one)
	c := newCLI(t, api)

	table := `NAME            TYPE           SCHEDULE                NEXT      LIMIT
nightly-report  reports.build  0 2 * * * Europe/Paris  in 13h    2
sync            crm.sync       @every 30s UTC          in 12s    -
weekly          reports.build  @weekly UTC             paused    -
old             crm.sync       @daily UTC              inactive  -
on-demand       emails.send    -                       -         -
`
	for _, args := range [][]string{{"jobs"}, {"jobs", "ls"}, {"jobs", "list"}} {
		r := c.run(args...)
		require.Equal(t, 0, r.code, r.stderr)
		require.Equal(t, table, r.stdout, "%v", args)
	}
	r := c.run("jobs", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, jobsJSON, r.stdout)

	r = c.run("jobs", "get", "nightly-report")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `name:              nightly-report
id:                j1
type:              reports.build
state:             active
schedule:          0 2 * * * Europe/Paris
missed ticks:      skip
next:              2026-11-24T01:00:00.000Z (in 13h)
priority:          7
max attempts:      10
timeout:           10m0s
heartbeat timeout: 1m0s
limit:             2
limit per key:     1
payload:           {"format":"pdf"}
config hash:       abc123
created:           2026-11-23T11:00:00.000Z
updated:           2026-11-23T11:30:00.000Z
`, r.stdout)
	r = c.run("jobs", "get", "nightly-report", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, one, r.stdout)

	r = c.run("jobs", "pause", "nightly-report")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "job nightly-report paused\n", r.stdout)
	r = c.run("jobs", "resume", "nightly-report")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "job nightly-report resumed (next tick in 13h)\n", r.stdout)

	var calls []string
	for _, req := range api.recorded() {
		calls = append(calls, req.Method+" "+req.Path)
	}
	require.Equal(t, []string{"GET /v1/jobs", "GET /v1/jobs", "GET /v1/jobs", "GET /v1/jobs", "GET /v1/jobs/nightly-report",
		"GET /v1/jobs/nightly-report", "POST /v1/jobs/nightly-report/pause", "POST /v1/jobs/nightly-report/resume"}, calls)

	r = c.run("jobs", "get")
	require.Equal(t, 2, r.code)
	require.Equal(t, "conveyor: get wants NAME, got 0 arguments\nRun 'conveyor jobs get --help' for usage.\n", r.stderr)
}

// trigger sends a payload and a key only when given, and --wait follows
// the task as submit --wait does.
func TestJobsTrigger(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("POST /v1/jobs/{name}/trigger", 201, `{"id":"w1","type":"reports.build","status":"PENDING","job_id":"j1","created_at":"2026-11-23T12:00:00Z"}`)
	api.stream("w1",
		streamEvent(1, "w1", "PENDING", "Queued", 0, ""),
		streamEvent(2, "w1", "COMPLETED", "Completed", 100, ""))
	payloadFile := writeFile(t, "payload.json", `{"format": "csv"}`)
	c := newCLI(t, api)
	c.stdin = strings.NewReader(`{"from":"stdin"}`) // not read unless asked

	r := c.run("jobs", "trigger", "nightly-report")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "w1\n", r.stdout)
	r = c.run("jobs", "trigger", "nightly-report", "--payload-file", payloadFile, "--concurrency-key", "acct-1", "--wait")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `w1
2026-11-23T12:00:01.500Z  w1  PENDING       0%  Queued
2026-11-23T12:00:02.500Z  w1  COMPLETED   100%  Completed
`, r.stdout)
	r = c.run("jobs", "trigger", "nightly-report", "-p", "[1]")
	require.Equal(t, 2, r.code)
	require.Equal(t, "conveyor: the payload (--payload) must be a JSON object, {…}\nRun 'conveyor jobs trigger --help' for usage.\n", r.stderr)

	reqs := api.recorded()
	require.Equal(t, "/v1/jobs/nightly-report/trigger", reqs[0].Path)
	require.JSONEq(t, `{}`, reqs[0].Body)
	require.JSONEq(t, `{"payload":{"format":"csv"},"concurrency_key":"acct-1"}`, reqs[1].Body)
}

func TestTypes(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	types := `{"types":[{"type":"emails.send","max_concurrency":10,"max_concurrency_per_key":1,"paused":false},
		{"type":"reports.build","paused":true,"paused_at":"2026-11-23T11:55:00Z"}]}`
	api.json("GET /v1/types", 200, types)
	api.json("POST /v1/types/{type}/pause", 200, `{"type":"reports.build","paused":true,"paused_at":"2026-11-23T12:00:00Z"}`)
	api.json("POST /v1/types/{type}/resume", 200, `{"type":"reports.build","paused":false}`)
	api.problem("POST /v1/types/Bad/pause", 422, `type: invalid type "Bad"`)
	c := newCLI(t, api)

	r := c.run("types")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `TYPE           LIMIT  PER-KEY  PAUSED
emails.send    10     1        no
reports.build  -      -        yes, 5m ago
`, r.stdout)
	r = c.run("types", "ls", "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, types, r.stdout)

	r = c.run("types", "pause", "reports.build")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "type reports.build paused\n", r.stdout)
	r = c.run("types", "resume", "reports.build")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "type reports.build resumed\n", r.stdout)
	r = c.run("types", "pause", "Bad")
	require.Equal(t, 1, r.code)
	require.Equal(t, "conveyor: type: invalid type \"Bad\" (HTTP 422)\n", r.stderr)
}

// submit's concurrency key and timeouts: whole seconds, or refused.
func TestSubmitSchedulingFlags(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("POST /v1/tasks", 201, `{"id":"new-id","type":"demo.sleep","status":"PENDING","created_at":"2026-11-23T12:00:00Z"}`)
	c := newCLI(t, api)

	r := c.run("submit", "demo.sleep", "--concurrency-key", "acct-1", "--task-timeout", "10m", "--heartbeat-timeout", "30s")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, `{"type":"demo.sleep","concurrency_key":"acct-1","timeout_seconds":600,"heartbeat_timeout_seconds":30}`,
		api.recorded()[0].Body)

	for _, tc := range []struct{ args, stderr string }{
		{"--task-timeout 1500ms", "conveyor: --task-timeout must be whole seconds, such as 90s or 10m, got 1.5s\n"},
		{"--heartbeat-timeout 500ms", "conveyor: --heartbeat-timeout must be whole seconds, such as 90s or 10m, got 500ms\n"},
		{"--task-timeout -1m", "conveyor: --task-timeout must be positive, got -1m0s\n"},
	} {
		r := c.run(append([]string{"submit", "demo.sleep"}, strings.Fields(tc.args)...)...)
		require.Equal(t, 2, r.code, tc.args)
		require.Equal(t, tc.stderr+"Run 'conveyor submit --help' for usage.\n", r.stderr)
	}
	require.Len(t, api.recorded(), 1, "a refused flag sends nothing")

	// The global --timeout is still the request's.
	r = c.run("--timeout", "5s", "submit", "demo.sleep")
	require.Equal(t, 0, r.code, r.stderr)
	require.JSONEq(t, `{"type":"demo.sleep"}`, api.recorded()[1].Body)
}

// get shows where a task came from and what holds it back, when set.
func TestGetShowsTheScheduling(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/tasks/{id}", 200, `{"id":"t1","type":"reports.build","status":"PENDING","state":"Queued","progress":0,
		"priority":7,"attempt":0,"max_attempts":10,"visibility":[],"payload":{},"metadata":{},"next_run_at":"2026-11-23T12:00:00Z",
		"created_at":"2026-11-23T12:00:00Z","updated_at":"2026-11-23T12:00:00Z","job_id":"j1","scheduled_at":"2026-11-23T12:00:00Z",
		"concurrency_key":"acct-1","waiting":true,"timeout_seconds":600,"heartbeat_timeout_seconds":60}`)
	r := newCLI(t, api).run("get", "t1")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `id:                t1
type:              reports.build
status:            PENDING
progress:          0%
state:             Queued
waiting:           yes, not yet admitted (a limit, a pause, or its turn in a busy type)
attempt:           0 of 10
priority:          7
concurrency key:   acct-1
timeout:           10m0s
heartbeat timeout: 1m0s
job:               j1
scheduled:         2026-11-23T12:00:00.000Z
created:           2026-11-23T12:00:00.000Z
next run:          2026-11-23T12:00:00.000Z
updated:           2026-11-23T12:00:00.000Z
payload:           {}
metadata:          {}
`, r.stdout)
}

// A task whose handler spawned children waits for them, PENDING and not
// admitted: get says it waits for its children, not for a limit, a pause
// or its turn, and shows no "next run" (the time it went back to PENDING,
// already past: it runs again when its last child ends, not then).
func TestGetOfATaskWaitingForItsChildren(t *testing.T) {
	t.Parallel()
	api := newFakeAPI(t)
	api.json("GET /v1/tasks/{id}", 200, `{"id":"t1","type":"demo.fanout","status":"PENDING","state":"Waiting for children",
		"progress":0,"priority":5,"attempt":0,"max_attempts":3,"visibility":[],"payload":{},"metadata":{},
		"next_run_at":"2026-11-23T12:00:01Z","created_at":"2026-11-23T12:00:00Z","started_at":"2026-11-23T12:00:00.5Z",
		"updated_at":"2026-11-23T12:00:01Z","waiting":true}`)
	r := newCLI(t, api).run("get", "t1")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, `id:       t1
type:     demo.fanout
status:   PENDING
progress: 0%
state:    Waiting for children
waiting:  yes, for its children to finish
attempt:  0 of 3
priority: 5
created:  2026-11-23T12:00:00.000Z
started:  2026-11-23T12:00:00.500Z
updated:  2026-11-23T12:00:01.000Z
payload:  {}
metadata: {}
`, r.stdout)
}
