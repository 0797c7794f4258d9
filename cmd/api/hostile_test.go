package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/config"
)

// Hostile input: every answer is a clear 4xx problem, nothing is written,
// and the API keeps serving everyone else.
func TestHostileInputIsRefusedCleanly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	deep := func(n int) string {
		return `{"type":"demo.sleep","payload":{"a":` + strings.Repeat("[", n) + strings.Repeat("]", n) + `}}`
	}
	tests := []struct {
		name, path, body string
		header           []string
		status           int
		mention          string
	}{
		{"nesting past any sane depth", "/v1/tasks", deep(100_000), nil, 400, "malformed"},
		{"nesting deeper than allowed", "/v1/tasks", deep(200), nil, 422, "levels deep"},
		{"invalid UTF-8 in type", "/v1/tasks", "{\"type\":\"demo.\xff\"}", nil, 422, "type"},
		{"invalid UTF-8 in payload", "/v1/tasks", "{\"type\":\"a\",\"payload\":{\"s\":\"\xc3\x28\"}}", nil, 422, "UTF-8"},
		{"invalid UTF-8 in idempotency key", "/v1/tasks", `{"type":"a"}`, []string{"Idempotency-Key", "k\xff"}, 422, "printable ASCII"},
		{"SQL in the type", "/v1/tasks", `{"type":"a'; DROP TABLE tasks; --"}`, nil, 422, "type"},
		{"huge max_attempts", "/v1/tasks", `{"type":"a","max_attempts":1e18}`, nil, 422, "max_attempts"},
		{"negative max_attempts", "/v1/tasks", `{"type":"a","max_attempts":-5}`, nil, 422, "max_attempts"},
		{"huge number in payload", "/v1/tasks", `{"type":"a","payload":{"n":1e400}}`, nil, 422, "payload"},
		{"huge priority as string", "/v1/tasks", `{"type":"a","priority":"99999999999999999999"}`, nil, 422, "priority"},
		{"metadata not an object", "/v1/tasks", `{"type":"a","metadata":"'; DROP TABLE tasks; --"}`, nil, 422, "metadata"},
		{"wrong type in a batch entry", "/v1/tasks/batch", `{"tasks":[{"type":"a","priority":"9"}]}`, nil, 422, "tasks.0.priority: must be an integer"},
		// The decoder names struct fields alone; the answer names the entry.
		{"wrong type in a later batch entry", "/v1/tasks/batch", `{"tasks":[{"type":"a","priority":1},{"type":"b"},{"type":"c","priority":"9"}]}`,
			nil, 422, "tasks.2.priority: must be an integer"},
		{"no time in a later batch entry", "/v1/tasks/batch", `{"tasks":[{"type":"a","run_at":"2026-01-02T15:04:05Z"},{"type":"b","RUN_AT":"soon"}]}`,
			nil, 422, "tasks.1.RUN_AT: must be an RFC 3339 time"},
		{"wrong type in a batch entry's list", "/v1/tasks/batch", `{"tasks":[{"type":"a"},{"type":"b","visibility":["x",7]}]}`,
			nil, 422, "tasks.1.visibility: must be a string"},
		{"a field given twice", "/v1/tasks", `{"type":"demo.sleep","type":"demo.noop"}`, nil, 422, "type: is given twice"},
		{"a field given twice in a batch entry", "/v1/tasks/batch", `{"tasks":[{"type":"a"},{"type":"a","priority":1,"priority":9}]}`,
			nil, 422, "tasks.1.priority: is given twice"},
		{"a payload's member given twice", "/v1/tasks", `{"type":"a","payload":{"n":1,"n":2}}`, nil, 422, "payload.n: is given twice"},
		// The decoder takes a name for a field it matches ignoring case.
		{"a field given twice in two cases", "/v1/tasks", `{"type":"demo.sleep","Type":"demo.noop"}`, nil, 422, "Type: is given twice"},
		{"dedupe given twice in two cases", "/v1/tasks", `{"type":"a","payload":{"n":1},"dedupe":true,"DEDUPE":false}`,
			nil, 422, "DEDUPE: is given twice"},
		{"a batch entry's key given twice in two cases", "/v1/tasks/batch",
			`{"tasks":[{"type":"a","idempotency_key":"k1","Idempotency_Key":"k2"}]}`, nil, 422, "tasks.0.Idempotency_Key: is given twice"},
		{"a bulk filter given twice in two cases", "/v1/tasks/cancel", `{"filter":{"type":"a","TYPE":"b"},"dry_run":true}`,
			nil, 422, "filter.TYPE: is given twice"},
	}
	before := b.counts(t)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := b.do(t, http.MethodPost, tt.path, "application/json", tt.body, tt.header...)
			require.Equal(t, tt.status, resp.status, string(resp.body))
			require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"))
			require.Contains(t, resp.json(t)["detail"], tt.mention)
			require.Equal(t, before, b.counts(t), "refused input writes nothing")
		})
	}
	for _, path := range []string{
		"/v1/tasks?type=a'%20OR%201=1", "/v1/tasks?status=PENDING'%20OR%20'1'='1", "/v1/tasks?limit=-1",
		"/v1/tasks?limit=99999999999999999999", "/v1/tasks?cursor=%27%3B--", "/v1/tasks?type=%ff",
	} {
		resp := b.get(t, path)
		require.True(t, resp.status == 200 || (resp.status >= 400 && resp.status < 500), "%s: %d %s", path, resp.status, resp.body)
		if resp.status == 200 {
			require.Empty(t, resp.json(t)["tasks"], "%s matches nothing", path)
		}
	}
	require.Equal(t, before, b.counts(t))

	// SQL metacharacters in the data are data: stored and given back as sent.
	sqlish := `'; DROP TABLE tasks; -- \" OR 1=1 /* */`
	resp := b.post(t, "/v1/tasks", fmt.Sprintf(`{"type":"demo.sleep","payload":{"q":%q},"metadata":{"m":%q}}`, sqlish, sqlish),
		"Idempotency-Key", "x'; DELETE FROM outbox; --")
	require.Equal(t, http.StatusCreated, resp.status, string(resp.body))
	got := resp.json(t)
	require.Equal(t, sqlish, got["payload"].(map[string]any)["q"])
	require.Equal(t, sqlish, got["metadata"].(map[string]any)["m"])
}

// Slow clients hold no handler: a client that never finishes its headers is
// cut off after the read-header timeout, and others are served meanwhile.
func TestSlowClientsDoNotStarveOthers(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *config.API) { c.ReadHeaderTimeout, c.ReadTimeout = 500*time.Millisecond, time.Second })
	addr := strings.TrimPrefix(b.base, "http://")
	var wg sync.WaitGroup
	closed := make(chan time.Duration, 50)
	for range 50 {
		conn, err := net.Dial("tcp", addr)
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		_, err = conn.Write([]byte("POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"))
		require.NoError(t, err)
		wg.Add(1)
		go func() {
			defer wg.Done()
			start := time.Now()
			_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			_, _ = bufio.NewReader(conn).ReadString('\n') // the server's 408 or its close
			closed <- time.Since(start)
		}()
	}
	for i := range 20 {
		resp := b.post(t, "/v1/tasks", fmt.Sprintf(`{"type":"demo.sleep","payload":{"served":%d}}`, i))
		require.Equal(t, http.StatusCreated, resp.status)
	}
	wg.Wait()
	close(closed)
	for d := range closed {
		require.Less(t, d, 5*time.Second, "slow connections are cut by the server, not by the test")
	}
}

// A request that names a role, a user or a workflow removed by a
// concurrent request while it waits for that row is refused as if it had
// come second (4xx), never a 500, and writes nothing.
func TestRequestsRacingARemovalAreRefusedCleanly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	role := func(slug string) {
		resp := b.post(t, "/v1/roles", `{"slug":"`+slug+`"}`)
		require.Equal(t, http.StatusCreated, resp.status, string(resp.body))
	}
	user := func(sub string) string {
		resp := b.post(t, "/v1/users", `{"external_id":"`+sub+`","role":"reader"}`)
		require.Equal(t, http.StatusCreated, resp.status, string(resp.body))
		return resp.json(t)["id"].(string)
	}
	applied := b.apply(t, "", "application/yaml", "jobs:\n  - {name: race-job, type: demo.noop}\nworkflows:\n  - {name: race-flow, nodes: [{job: race-job}]}\n")
	require.Equal(t, http.StatusOK, applied.status, string(applied.body))

	// removing holds what the concurrent removal (DELETE /v1/roles/{slug},
	// DELETE /v1/users/{id}, apply --prune) holds before its commit, sends
	// the request, and commits once the request waits for that row.
	removing := func(sql string, send func() response) response {
		tx, err := b.db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		_, err = tx.Exec(ctx, sql)
		require.NoError(t, err)
		answer := make(chan response, 1)
		go func() { answer <- send() }()
		b.db.WaitForLockWait(t)
		require.NoError(t, tx.Commit(ctx))
		return <-answer
	}

	role("race-a")
	resp := removing(`DELETE FROM org_roles WHERE slug = 'race-a'`, func() response {
		return b.post(t, "/v1/keys", `{"name":"racer","role":"reader","org_roles":["race-a"]}`)
	})
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, string(resp.body))
	require.Equal(t, "org_roles", resp.json(t)["field"])
	require.Zero(t, b.rowCount(t, "api_keys", "name = 'racer'"), "nothing written")

	role("race-b")
	id := user("racer-1")
	resp = removing(`DELETE FROM users WHERE external_id = 'racer-1'`, func() response {
		return b.do(t, http.MethodPut, "/v1/roles/race-b/members/"+id, "", "")
	})
	require.Equal(t, http.StatusNotFound, resp.status, string(resp.body))

	id = user("racer-2")
	resp = removing(`DELETE FROM org_roles WHERE slug = 'race-b'`, func() response {
		return b.do(t, http.MethodPut, "/v1/roles/race-b/members/"+id, "", "")
	})
	require.Equal(t, http.StatusNotFound, resp.status, string(resp.body))

	resp = removing(`DELETE FROM workflows WHERE name = 'race-flow'`, func() response {
		return b.post(t, "/v1/workflows/race-flow/runs", `{}`)
	})
	require.Equal(t, http.StatusNotFound, resp.status, string(resp.body))
	require.Zero(t, b.rowCount(t, "workflow_runs", "true"), "nothing written")
	require.Zero(t, b.rowCount(t, "tasks", "true"), "nothing written")
}

// A 404 names what is missing: a job, a workflow or a run is not a task.
func TestNotFoundNamesWhatIsMissing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	run := "/v1/runs/" + uuid.NewString()
	for _, c := range []struct{ method, path, what string }{
		{http.MethodGet, "/v1/jobs/nope", "job"},
		{http.MethodPost, "/v1/jobs/nope/trigger", "job"},
		{http.MethodPost, "/v1/jobs/nope/pause", "job"},
		{http.MethodPost, "/v1/jobs/nope/resume", "job"},
		{http.MethodGet, "/v1/workflows/nope", "workflow"},
		{http.MethodPost, "/v1/workflows/nope/runs", "workflow"},
		{http.MethodGet, run, "run"},
		{http.MethodPost, run + "/cancel", "run"},
		{http.MethodPost, run + "/retry", "run"},
		{http.MethodGet, "/v1/runs/not-a-uuid", "run"},
		// Names no job or workflow can have (not even text PostgreSQL takes).
		{http.MethodGet, "/v1/jobs/%00", "job"},
		{http.MethodPost, "/v1/jobs/%C3%28/pause", "job"},
		{http.MethodPost, "/v1/jobs/%00/trigger", "job"},
		{http.MethodGet, "/v1/workflows/%C3%28", "workflow"},
		{http.MethodPost, "/v1/workflows/%00/runs", "workflow"},
	} {
		resp := b.do(t, c.method, c.path, "", "")
		require.Equal(t, http.StatusNotFound, resp.status, "%s %s: %s", c.method, c.path, resp.body)
		detail := resp.json(t)["detail"].(string)
		require.Contains(t, detail, c.what, "%s %s", c.method, c.path)
		require.NotContains(t, detail, "task", "%s %s", c.method, c.path)
	}
}

// Client input alone never makes a metric series: a request with a method
// of its own making, authenticated or not, is counted under "other".
func TestMadeUpMethodsMakeNoMetricSeries(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for i := range 3 {
		resp := b.do(t, fmt.Sprintf("BREW%d", i), "/v1/tasks", "", "", "Authorization", "")
		require.Equal(t, http.StatusMethodNotAllowed, resp.status, string(resp.body))
	}
	metrics := string(b.get(t, "/metrics").body)
	require.False(t, strings.Contains(metrics, "BREW"), "a made-up method is no label")
	require.Equal(t, "3", metricValue(metrics,
		`conveyor_http_request_duration_seconds_count{code="405",method="other",route="unmatched"}`))
}

// A string of invalid UTF-8, or with an unpaired UTF-16 surrogate escape,
// is refused naming its field, wherever it sits in a body: JSON decoding
// would turn it into U+FFFD, and a key's name or a user's subject would be
// stored as text other than was sent, without a word.
func TestTextThatIsNotUnicodeIsRefusedNotReplaced(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rows := func() [4]int {
		return [4]int{b.rowCount(t, "api_keys", "true"), b.rowCount(t, "users", "true"),
			b.rowCount(t, "org_roles", "true"), b.rowCount(t, "tasks", "true")}
	}
	before := rows()
	for _, c := range []struct{ path, body, field string }{
		{"/v1/keys", `{"name":"deploy\ud800","role":"reader"}`, "name"},
		{"/v1/keys", "{\"name\":\"deploy\xff\",\"role\":\"reader\"}", "name"},
		{"/v1/users", `{"external_id":"alice\udc00","role":"reader"}`, "external_id"},
		{"/v1/users", "{\"external_id\":\"alice\",\"email\":\"a\xc3\x28@example.com\",\"role\":\"reader\"}", "email"},
		{"/v1/roles", `{"slug":"finance","name":"Finance \ud83d"}`, "name"},
		{"/v1/tasks/batch", `{"tasks":[{"type":"a"},{"type":"a","payload":{"s":"\ud800\u0041"}}]}`, "tasks.1.payload.s"},
		{"/v1/tasks/cancel", `{"filter":{"q":"team=\udfff"},"dry_run":true}`, "filter.q"},
	} {
		resp := b.post(t, c.path, c.body)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s %s: %s", c.path, c.body, resp.body)
		p := resp.json(t)
		require.Equal(t, c.field, p["field"], "%s %s", c.path, c.body)
		require.Contains(t, p["detail"], "not valid text")
		require.Equal(t, before, rows(), "%s %s writes nothing", c.path, c.body)
	}
}
