package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
)

// apply sends a jobs file to POST /v1/jobs/apply with the query and
// content type given.
func (b *testBundle) apply(t *testing.T, query, contentType, file string) response {
	t.Helper()
	return b.do(t, http.MethodPost, "/v1/jobs/apply"+query, contentType, file)
}

// applied sends a YAML jobs file, requires a 200 and returns its changes
// as "op kind name".
func (b *testBundle) applied(t *testing.T, query, file string) []string {
	t.Helper()
	resp := b.apply(t, query, "application/yaml", file)
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	return changeOps(t, resp)
}

// changeOps lists an apply's changes as "op kind name".
func changeOps(t *testing.T, resp response) []string {
	t.Helper()
	var out []string
	for _, c := range resp.json(t)["changes"].([]any) {
		c := c.(map[string]any)
		out = append(out, fmt.Sprintf("%s %s %s", c["op"], c["kind"], c["name"]))
	}
	return out
}

// jobsByName reads GET /v1/jobs.
func (b *testBundle) jobsByName(t *testing.T) map[string]map[string]any {
	t.Helper()
	resp := b.get(t, "/v1/jobs")
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	out := map[string]map[string]any{}
	for _, j := range resp.json(t)["jobs"].([]any) {
		j := j.(map[string]any)
		out[j["name"].(string)] = j
	}
	return out
}

// typesByName reads GET /v1/types.
func (b *testBundle) typesByName(t *testing.T) map[string]map[string]any {
	t.Helper()
	resp := b.get(t, "/v1/types")
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	out := map[string]map[string]any{}
	for _, v := range resp.json(t)["types"].([]any) {
		v := v.(map[string]any)
		out[v["type"].(string)] = v
	}
	return out
}

// schedule is the source.schedule of a job as GET shows it.
func schedule(j map[string]any) string {
	return j["source"].(map[string]any)["schedule"].(string)
}

// jobsFile is a file of a cron job (report, on the schedule given), a job
// run only when triggered (reindex) and a limit of report's type.
func jobsFile(sched string) string {
	return `jobs:
  - name: report
    type: jobs.report
    payload: {format: pdf}
    source:
      kind: cron
      schedule: "` + sched + `"
      timezone: Europe/Paris
  - name: reindex
    type: jobs.reindex
types:
  - type: jobs.report
    max_concurrency: 2
`
}

// Applying a file creates what it declares; applying it again changes
// nothing (not even updated_at); a changed schedule is one update naming
// the field; a dry run reports without writing; and what the file leaves
// out stays unless pruned.
func TestApplyIsIdempotentAndPrunesOnlyWhenAsked(t *testing.T) {
	t.Parallel()
	b := setup(t)

	created := b.apply(t, "", "application/yaml", jobsFile("0 2 * * *"))
	require.Equal(t, http.StatusOK, created.status, string(created.body))
	require.Equal(t, false, created.json(t)["dry_run"])
	require.Equal(t, []string{"create job reindex", "create job report", "create type jobs.report"}, changeOps(t, created))
	report := created.json(t)["changes"].([]any)[1].(map[string]any)
	require.Contains(t, report["fields"], map[string]any{"field": "source.schedule", "old": "", "new": "0 2 * * *"},
		"a create lists the fields it sets")

	jobs := b.jobsByName(t)
	require.Len(t, jobs, 2)
	for name, j := range jobs {
		require.Regexp(t, `^[0-9a-f]{64}$`, j["config_hash"], name)
		require.Equal(t, false, j["paused"], name)
		require.Equal(t, true, j["active"], name)
	}
	require.Equal(t, map[string]any{"kind": "cron", "schedule": "0 2 * * *", "timezone": "Europe/Paris", "missed": "run_once"},
		jobs["report"]["source"], "defaults are filled in")
	require.Equal(t, map[string]any{"format": "pdf"}, jobs["report"]["payload"])
	next, err := time.Parse(time.RFC3339Nano, jobs["report"]["next_tick_at"].(string))
	require.NoError(t, err)
	paris, err := time.LoadLocation("Europe/Paris")
	require.NoError(t, err)
	require.True(t, next.After(time.Now()), "the cursor starts at the next tick: %s", next)
	require.Equal(t, 2, next.In(paris).Hour(), "02:00 in the job's time zone: %s", next)
	require.NotContains(t, jobs["reindex"], "next_tick_at", "a job without a schedule has no tick")
	require.NotContains(t, jobs["reindex"], "source")
	require.Equal(t, map[string]any{"type": "jobs.report", "max_concurrency": float64(2), "paused": false},
		b.typesByName(t)["jobs.report"])

	// The same file, again and in JSON with its defaults written out: no
	// change, and nothing rewritten.
	require.Equal(t, []string{"unchanged job reindex", "unchanged job report", "unchanged type jobs.report"},
		b.applied(t, "", jobsFile("0 2 * * *")))
	asJSON := b.apply(t, "", "application/json", `{
	"jobs": [
		{"name": "reindex", "type": "jobs.reindex", "priority": 5, "max_attempts": 3, "payload": {}, "active": true},
		{"name": "report", "type": "jobs.report", "payload": {"format": "pdf"},
		 "source": {"kind": "cron", "schedule": "0 2 * * *", "timezone": "Europe/Paris", "missed": "run_once"}}
	],
	"types": [{"type": "jobs.report", "max_concurrency": 2}]
}`)
	require.Equal(t, http.StatusOK, asJSON.status, string(asJSON.body))
	require.Equal(t, []string{"unchanged job reindex", "unchanged job report", "unchanged type jobs.report"}, changeOps(t, asJSON))
	again := b.jobsByName(t)
	for name := range jobs {
		for _, field := range []string{"updated_at", "config_hash", "next_tick_at"} {
			require.Equal(t, jobs[name][field], again[name][field], "%s: %s", name, field)
		}
	}

	// One schedule changes: one update, naming the field.
	changed := b.apply(t, "", "application/yaml", jobsFile("30 3 * * *"))
	require.Equal(t, http.StatusOK, changed.status, string(changed.body))
	require.Equal(t, []string{"unchanged job reindex", "update job report", "unchanged type jobs.report"}, changeOps(t, changed))
	require.Equal(t, []any{map[string]any{"field": "source.schedule", "old": "0 2 * * *", "new": "30 3 * * *"}},
		changed.json(t)["changes"].([]any)[1].(map[string]any)["fields"])
	after := b.jobsByName(t)
	require.Equal(t, "30 3 * * *", schedule(after["report"]))
	require.NotEqual(t, jobs["report"]["config_hash"], after["report"]["config_hash"])
	require.NotEqual(t, jobs["report"]["next_tick_at"], after["report"]["next_tick_at"], "a new schedule moves the cursor")
	require.Equal(t, jobs["reindex"]["updated_at"], after["reindex"]["updated_at"], "the unchanged job is not rewritten")

	// A dry run reports the change and makes none.
	dry := b.apply(t, "?dry_run=true", "application/yaml", jobsFile("@every 1m"))
	require.Equal(t, http.StatusOK, dry.status, string(dry.body))
	require.Equal(t, true, dry.json(t)["dry_run"])
	require.Equal(t, []string{"unchanged job reindex", "update job report", "unchanged type jobs.report"}, changeOps(t, dry))
	require.Equal(t, []any{map[string]any{"field": "source.schedule", "old": "30 3 * * *", "new": "@every 1m"}},
		dry.json(t)["changes"].([]any)[1].(map[string]any)["fields"])
	require.Equal(t, after, b.jobsByName(t), "a dry run writes nothing")

	// A file without reindex and the type limit leaves them be...
	onlyReport := strings.Split(jobsFile("30 3 * * *"), "  - name: reindex")[0]
	require.Equal(t, []string{"unchanged job report"}, b.applied(t, "?prune=false", onlyReport))
	require.Contains(t, b.jobsByName(t), "reindex")
	require.Contains(t, b.typesByName(t), "jobs.report")
	// ...a dry run of the prune says what it would delete...
	pruned := []string{"delete job reindex", "unchanged job report", "delete type jobs.report"}
	require.Equal(t, pruned, b.applied(t, "?prune=true&dry_run=true", onlyReport))
	require.Contains(t, b.jobsByName(t), "reindex")
	// ...and the prune deletes them.
	require.Equal(t, pruned, b.applied(t, "?prune=true", onlyReport))
	require.Equal(t, []string{"report"}, keys(b.jobsByName(t)))
	requireUnlimited(t, b, "jobs.report")
	require.Equal(t, http.StatusNotFound, b.get(t, "/v1/jobs/reindex").status)
	require.Equal(t, []string{"unchanged job report"}, b.applied(t, "?prune=true", onlyReport), "pruning twice deletes nothing more")
}

func keys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// A file with mistakes is refused whole: the 422 lists every mistake with
// its line, and no job changes, not even the file's valid ones.
func TestApplyReportsEveryMistakeAndWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	require.Equal(t, []string{"create job keep"}, b.applied(t, "", "jobs:\n  - name: keep\n    type: jobs.keep\n"))
	before := b.get(t, "/v1/jobs")

	resp := b.apply(t, "", "application/yaml", `jobs:
  - name: keep
    type: jobs.keep
    payload: {changed: true}
  - name: nightly
    type: jobs.nightly
    colour: blue
    source:
      kind: cron
      schedule: "61 * * * *"
  - name: keep
    type: jobs.other
`)
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, string(resp.body))
	require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"))
	body := resp.json(t)
	require.Contains(t, body["detail"], "3 mistake(s)")
	errs := body["errors"].([]any)
	require.Len(t, errs, 3, string(resp.body))
	want := []struct {
		line    float64
		path    string
		message string
	}{
		{7, "jobs[1].colour", `unknown field "colour"`},
		{10, "jobs[1].source.schedule", "61 * * * *"},
		{11, "jobs[2].name", `duplicate job name "keep"`},
	}
	for i, w := range want {
		e := errs[i].(map[string]any)
		require.Equal(t, w.line, e["line"], "%d: %v", i, e)
		require.Greater(t, e["column"], float64(0), "%d: %v", i, e)
		require.Equal(t, w.path, e["path"], "%d: %v", i, e)
		require.Contains(t, e["message"], w.message, "%d: %v", i, e)
	}

	require.Equal(t, string(before.body), string(b.get(t, "/v1/jobs").body), "a refused file writes nothing")

	// A mistake in JSON has its line too.
	resp = b.apply(t, "", "application/json", "{\"jobs\": [\n  {\"name\": \"x\", \"type\": \"jobs.x\",\n   \"priority\": 12}\n]}")
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, string(resp.body))
	e := resp.json(t)["errors"].([]any)[0].(map[string]any)
	require.Equal(t, float64(3), e["line"], "%v", e)
	require.Equal(t, "jobs[0].priority", e["path"])
	require.Equal(t, string(before.body), string(b.get(t, "/v1/jobs").body))

	// A number beyond a float64's range is refused, as a submission's is,
	// not turned into a string.
	resp = b.apply(t, "", "application/json", `{"jobs": [{"name": "big", "type": "jobs.big", "payload": {"n": 1e400}}]}`)
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, string(resp.body))
	e = resp.json(t)["errors"].([]any)[0].(map[string]any)
	require.Equal(t, "jobs[0].payload.n", e["path"], "%v", e)
	require.Contains(t, e["message"], "1e400")
	require.Equal(t, string(before.body), string(b.get(t, "/v1/jobs").body))
}

// Apply takes YAML under any of its media types and JSON; anything else is
// a 415 that writes nothing, as is a query flag that is not a boolean.
func TestApplyContentTypes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for i, ct := range []string{"application/yaml", "application/x-yaml", "text/yaml; charset=utf-8"} {
		name := fmt.Sprintf("yaml-%d", i)
		resp := b.apply(t, "", ct, "jobs:\n  - name: "+name+"\n    type: jobs.ct\n")
		require.Equal(t, http.StatusOK, resp.status, "%s: %s", ct, resp.body)
		require.Equal(t, "create job "+name, changeOps(t, resp)[0], ct)
	}
	resp := b.apply(t, "", "application/json", `{"jobs":[{"name":"json","type":"jobs.ct","payload":{"a":[1,2]}}]}`)
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	require.Contains(t, changeOps(t, resp), "create job json")
	require.Equal(t, map[string]any{"a": []any{float64(1), float64(2)}}, b.jobsByName(t)["json"]["payload"])

	before := b.get(t, "/v1/jobs")
	for _, ct := range []string{"text/plain", ""} {
		resp := b.apply(t, "", ct, "jobs:\n  - name: plain\n    type: jobs.ct\n")
		require.Equal(t, http.StatusUnsupportedMediaType, resp.status, "%q: %s", ct, resp.body)
		require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"))
	}
	resp = b.apply(t, "?dry_run=maybe", "application/yaml", "jobs:\n  - name: plain\n    type: jobs.ct\n")
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, string(resp.body))
	require.Equal(t, "dry_run", resp.json(t)["field"])
	require.Equal(t, string(before.body), string(b.get(t, "/v1/jobs").body))
}

// A trigger makes a task as the job defines it, with the job's payload or
// the one given, each time anew; an unknown job is a 404.
func TestTriggerMakesATaskOfTheJob(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.applied(t, "", `jobs:
  - name: export
    type: jobs.export
    payload: {table: users}
    priority: 7
    max_attempts: 5
    timeout_seconds: 60
    heartbeat_timeout_seconds: 10
`)
	jobID := b.jobsByName(t)["export"]["id"].(string)

	first := b.post(t, "/v1/jobs/export/trigger", "")
	require.Equal(t, http.StatusCreated, first.status, string(first.body))
	task := first.json(t)
	require.Equal(t, "/v1/tasks/"+task["id"].(string), first.header.Get("Location"))
	require.Equal(t, jobID, task["job_id"])
	require.Equal(t, "jobs.export", task["type"])
	require.Equal(t, map[string]any{"table": "users"}, task["payload"])
	require.EqualValues(t, 7, task["priority"])
	require.EqualValues(t, 5, task["max_attempts"])
	require.EqualValues(t, 60, task["timeout_seconds"])
	require.EqualValues(t, 10, task["heartbeat_timeout_seconds"])
	require.Equal(t, "PENDING", task["status"])
	require.Equal(t, false, task["waiting"], "nothing limits the job")
	require.NotContains(t, task, "scheduled_at", "a trigger is not a tick")
	read := b.get(t, "/v1/tasks/"+task["id"].(string))
	require.Equal(t, http.StatusOK, read.status)
	require.Equal(t, jobID, read.json(t)["job_id"])

	second := b.post(t, "/v1/jobs/export/trigger", `{"payload":{"table":"orders"},"concurrency_key":"tenant-7"}`)
	require.Equal(t, http.StatusCreated, second.status, string(second.body))
	require.Equal(t, map[string]any{"table": "orders"}, second.json(t)["payload"])
	require.Equal(t, "tenant-7", second.json(t)["concurrency_key"])
	require.Equal(t, jobID, second.json(t)["job_id"])

	third := b.post(t, "/v1/jobs/export/trigger", "")
	require.Equal(t, http.StatusCreated, third.status, string(third.body))
	require.NotEqual(t, task["id"], third.json(t)["id"], "a trigger is never a duplicate")

	list := b.get(t, "/v1/tasks?type=jobs.export")
	require.Equal(t, http.StatusOK, list.status)
	summaries := list.json(t)["tasks"].([]any)
	require.Len(t, summaries, 3)
	for _, s := range summaries {
		require.Equal(t, jobID, s.(map[string]any)["job_id"], "summaries carry the job")
	}

	before := b.counts(t)
	missing := b.post(t, "/v1/jobs/nope/trigger", "")
	require.Equal(t, http.StatusNotFound, missing.status, string(missing.body))
	require.Equal(t, "application/problem+json", missing.header.Get("Content-Type"))
	bad := b.post(t, "/v1/jobs/export/trigger", `{"concurrency_key":"`+strings.Repeat("k", 256)+`"}`)
	require.Equal(t, http.StatusUnprocessableEntity, bad.status, string(bad.body))
	require.Equal(t, before, b.counts(t), "a refused trigger writes nothing")
}

// A job's payload keeps the numbers its file gives, as a submission's
// does: YAML reads a number past a float64's precision or range as a
// rounding of it, which the job's tasks would have been given instead.
func TestAJobsPayloadKeepsItsNumbers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const payload = `{"id":123456789012345678901234567890,"amount":0.10000000000000001,"rate":123456789.123456789,"tiny":1e-400,"plain":0.1}`
	for _, file := range []struct{ contentType, body string }{
		{"application/yaml", "jobs:\n  - name: exact\n    type: jobs.exact\n    payload: " + payload + "\n"},
		{"application/json", `{"jobs":[{"name":"exact","type":"jobs.exact","payload":` + payload + `}]}`},
	} {
		resp := b.apply(t, "", file.contentType, file.body)
		require.Equal(t, http.StatusOK, resp.status, string(resp.body))
		triggered := b.post(t, "/v1/jobs/exact/trigger", "")
		require.Equal(t, http.StatusCreated, triggered.status, string(triggered.body))
		submitted := b.post(t, "/v1/tasks", `{"type":"jobs.exact","dedupe":false,"payload":`+payload+`}`)
		require.Equal(t, http.StatusCreated, submitted.status, string(submitted.body))
		var got, want struct{ Payload json.RawMessage }
		require.NoError(t, json.Unmarshal(triggered.body, &got))
		require.NoError(t, json.Unmarshal(submitted.body, &want))
		require.Equal(t, string(want.Payload), string(got.Payload), file.contentType)
	}
}

// A paused job or type keeps its tasks waiting (not admitted: state
// "Waiting"), those already queued included, and says so; resuming it
// lets new ones through. A type's pause is the org's alone.
func TestPauseAndResumeJobsAndTypes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.applied(t, "", "jobs:\n  - name: tick\n    type: jobs.tick\n    source: {kind: cron, schedule: '@every 1h'}\n")

	paused := b.post(t, "/v1/jobs/tick/pause", "")
	require.Equal(t, http.StatusOK, paused.status, string(paused.body))
	require.Equal(t, true, paused.json(t)["paused"])
	j := b.get(t, "/v1/jobs/tick").json(t)
	require.Equal(t, true, j["paused"])
	require.Contains(t, j, "paused_at")
	require.NotContains(t, j, "next_tick_at", "a paused job's schedule does not tick")
	require.Equal(t, http.StatusOK, b.post(t, "/v1/jobs/tick/pause", "").status, "pausing twice is fine")
	require.Equal(t, j["paused_at"], b.get(t, "/v1/jobs/tick").json(t)["paused_at"], "and keeps the first paused_at")

	triggered := b.post(t, "/v1/jobs/tick/trigger", "")
	require.Equal(t, http.StatusCreated, triggered.status, string(triggered.body))
	requireWaiting(t, b, triggered.json(t)["id"].(string), true)

	resumed := b.post(t, "/v1/jobs/tick/resume", "")
	require.Equal(t, http.StatusOK, resumed.status, string(resumed.body))
	require.Equal(t, false, resumed.json(t)["paused"])
	j = b.get(t, "/v1/jobs/tick").json(t)
	require.Equal(t, false, j["paused"])
	require.NotContains(t, j, "paused_at")
	require.Contains(t, j, "next_tick_at")
	require.Equal(t, http.StatusNotFound, b.post(t, "/v1/jobs/nope/pause", "").status)
	require.Equal(t, http.StatusNotFound, b.post(t, "/v1/jobs/nope/resume", "").status)

	// A type: the task queued before the pause waits again, like the one
	// submitted during it; another org's tasks of the type do not.
	queued := b.submitTask(t, `{"type":"jobs.typed","payload":{"n":1}}`)
	requireWaiting(t, b, queued, false)
	resp := b.post(t, "/v1/types/jobs.typed/pause", "")
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	require.Equal(t, "jobs.typed", resp.json(t)["type"])
	require.Equal(t, true, resp.json(t)["paused"])
	require.Equal(t, true, b.typesByName(t)["jobs.typed"]["paused"])
	requireWaiting(t, b, queued, true)
	during := b.post(t, "/v1/tasks", `{"type":"jobs.typed","payload":{"n":2}}`)
	require.Equal(t, http.StatusCreated, during.status, string(during.body))
	require.Equal(t, true, during.json(t)["waiting"])
	require.Equal(t, "Waiting", during.json(t)["state"])
	requireWaiting(t, b, during.json(t)["id"].(string), true)
	list := b.get(t, "/v1/tasks?type=jobs.typed").json(t)["tasks"].([]any)
	require.Len(t, list, 2)
	for _, s := range list {
		require.Equal(t, true, s.(map[string]any)["waiting"], "summaries say it too")
	}

	other, _ := b.db.Key(t, "org-b", auth.Writer)
	elsewhere := b.post(t, "/v1/tasks", `{"type":"jobs.typed"}`, "Authorization", "Bearer "+other)
	require.Equal(t, http.StatusCreated, elsewhere.status, string(elsewhere.body))
	require.Equal(t, false, elsewhere.json(t)["waiting"], "another org's type is not paused")
	otherTypes := b.do(t, http.MethodGet, "/v1/types", "", "", "Authorization", "Bearer "+other)
	require.Equal(t, `{"types":[]}`, strings.TrimSpace(string(otherTypes.body)))

	resp = b.post(t, "/v1/types/jobs.typed/resume", "")
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	require.Equal(t, map[string]any{"type": "jobs.typed", "paused": false}, resp.json(t))
	requireUnlimited(t, b, "jobs.typed")
	after := b.post(t, "/v1/tasks", `{"type":"jobs.typed","payload":{"n":3}}`)
	require.Equal(t, http.StatusCreated, after.status, string(after.body))
	require.Equal(t, false, after.json(t)["waiting"])

	require.Equal(t, http.StatusUnprocessableEntity, b.post(t, "/v1/types/Not%20A%20Type/pause", "").status)
}

// requireUnlimited checks that GET /v1/types no longer lists a type whose
// limits and pause are gone.
func requireUnlimited(t *testing.T, b *testBundle, typ string) {
	t.Helper()
	_, listed := b.typesByName(t)[typ]
	require.False(t, listed, "a type with no limit and no pause is not listed")
}

// requireWaiting reads a task back and checks whether it waits for
// admission.
func requireWaiting(t *testing.T, b *testBundle, id string, waiting bool) {
	t.Helper()
	resp := b.get(t, "/v1/tasks/"+id)
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	task := resp.json(t)
	require.Equal(t, "PENDING", task["status"])
	require.Equal(t, waiting, task["waiting"], "%v", task)
	if waiting {
		require.Equal(t, "Waiting", task["state"])
	} else {
		require.NotEqual(t, "Waiting", task["state"])
	}
}

// A type limit from the jobs file makes new tasks of the type wait for the
// scheduler.
func TestTypeLimitMakesTasksWait(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.applied(t, "", "types:\n  - type: jobs.limited\n    max_concurrency_per_key: 1\n")
	keyed := b.post(t, "/v1/tasks", `{"type":"jobs.limited","concurrency_key":"a"}`)
	require.Equal(t, http.StatusCreated, keyed.status, string(keyed.body))
	require.Equal(t, true, keyed.json(t)["waiting"], "a per-key limit holds a task with a key")
	unkeyed := b.post(t, "/v1/tasks", `{"type":"jobs.limited","payload":{"n":1}}`)
	require.Equal(t, http.StatusCreated, unkeyed.status, string(unkeyed.body))
	require.Equal(t, false, unkeyed.json(t)["waiting"], "and not one without")
}

// The per-task scheduling fields are checked like the rest of a
// submission: a refusal names the field and writes nothing.
func TestSubmitChecksConcurrencyKeyAndTimeouts(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ok := b.post(t, "/v1/tasks", `{"type":"jobs.sub","concurrency_key":"`+strings.Repeat("k", 255)+
		`","timeout_seconds":30,"heartbeat_timeout_seconds":5}`)
	require.Equal(t, http.StatusCreated, ok.status, string(ok.body))
	require.Equal(t, strings.Repeat("k", 255), ok.json(t)["concurrency_key"])
	require.EqualValues(t, 30, ok.json(t)["timeout_seconds"])
	require.EqualValues(t, 5, ok.json(t)["heartbeat_timeout_seconds"])
	require.Equal(t, false, ok.json(t)["waiting"])

	before := b.counts(t)
	for body, field := range map[string]string{
		`{"type":"jobs.sub","concurrency_key":"` + strings.Repeat("k", 256) + `"}`: "concurrency_key",
		`{"type":"jobs.sub","concurrency_key":"tab\there"}`:                        "concurrency_key",
		`{"type":"jobs.sub","timeout_seconds":-1}`:                                 "timeout_seconds",
		`{"type":"jobs.sub","timeout_seconds":604801}`:                             "timeout_seconds",
		`{"type":"jobs.sub","heartbeat_timeout_seconds":-1}`:                       "heartbeat_timeout_seconds",
	} {
		resp := b.post(t, "/v1/tasks", body)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", body, resp.body)
		require.Equal(t, field, resp.json(t)["field"], body)
	}
	batch := b.post(t, "/v1/tasks/batch", `{"tasks":[{"type":"jobs.sub"},{"type":"jobs.sub","timeout_seconds":-1}]}`)
	require.Equal(t, http.StatusUnprocessableEntity, batch.status, string(batch.body))
	require.Contains(t, batch.json(t)["field"], "timeout_seconds")
	require.Equal(t, before, b.counts(t), "a refused submission writes nothing")
}

// A trigger's and a run's bodies are optional, however a client sends
// none: an empty body of no declared length (chunked) is no body either.
func TestOptionalBodiesMayBeEmptyAndChunked(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.applied(t, "", "jobs:\n  - {name: chunked, type: jobs.chunked}\nworkflows:\n  - {name: chunked-flow, nodes: [{job: chunked}]}\n")
	for _, path := range []string{"/v1/jobs/chunked/trigger", "/v1/workflows/chunked-flow/runs"} {
		req, err := http.NewRequest(http.MethodPost, b.base+path, io.MultiReader()) // no length: sent chunked
		require.NoError(t, err)
		req.ContentLength = -1
		req.Header.Set("Authorization", "Bearer "+b.token)
		resp, err := b.client.Do(req)
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
		require.Equal(t, http.StatusCreated, resp.StatusCode, "%s: %s", path, body)
	}
}

// A file with more mistakes than anyone reads is answered with the first
// hundred, not with each (an unknown dependency's message names the
// workflow's nodes, so a 27 kB file made a 21 MB answer, and 1 MiB one
// over a gigabyte): the answer, and the work, stay bounded.
func TestApplyListsABoundedNumberOfMistakes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var file strings.Builder
	file.WriteString("jobs:\n  - {name: j, type: jobs.j}\nworkflows:\n  - name: w\n    nodes:\n")
	for i := range 21 {
		fmt.Fprintf(&file, "      - {job: j, name: n%d-%s}\n", i, strings.Repeat("a", 120))
	}
	file.WriteString("      - {job: j, name: last, depends_on: [x" + strings.Repeat(", x", 8000) + "]}\n")
	resp := b.apply(t, "", "application/yaml", file.String())
	require.Equal(t, http.StatusUnprocessableEntity, resp.status)
	require.Less(t, len(resp.body), 512<<10, "a %d-byte file answered with %d bytes", file.Len(), len(resp.body))
	errs := resp.json(t)["errors"].([]any)
	require.LessOrEqual(t, len(errs), 101)
	require.Contains(t, errs[0].(map[string]any)["message"], `unknown node "x"`)
	require.Contains(t, errs[len(errs)-1].(map[string]any)["message"], "only the first 100")
	require.Empty(t, b.jobsByName(t), "nothing applied")
}

// A request with no body at all, or white space alone (`echo "$FILE"` of a
// missing file), lost its file: it is refused, and a prune with it deletes
// nothing. A file that declares nothing, sent as such, still prunes
// everything.
func TestApplyWithNoBodyIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	require.Equal(t, []string{"create job keep"}, b.applied(t, "", "jobs:\n  - name: keep\n    type: jobs.keep\n"))

	resp := b.apply(t, "?prune=true", "application/yaml", "")
	require.Equal(t, http.StatusBadRequest, resp.status, string(resp.body))
	require.Contains(t, string(resp.body), "request body is empty")
	require.Equal(t, []string{"keep"}, keys(b.jobsByName(t)), "a refused request deletes nothing")
	for _, blank := range []string{"\n", " \r\n\t\n"} {
		resp := b.apply(t, "?prune=true", "application/yaml", blank)
		require.Equal(t, http.StatusBadRequest, resp.status, "%q: %s", blank, resp.body)
		require.Contains(t, string(resp.body), "request body is empty")
	}
	require.Equal(t, []string{"keep"}, keys(b.jobsByName(t)), "a body of white space alone deletes nothing")

	require.Equal(t, []string{"delete job keep"}, b.applied(t, "?prune=true", "{}"))
	require.Empty(t, b.jobsByName(t))
}
