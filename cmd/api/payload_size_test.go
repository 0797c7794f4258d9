package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/task"
)

// bigNumbers is a JSON array of n copies of number: short as sent, long as
// PostgreSQL stores it when it writes the number out in full.
func bigNumbers(number string, n int) string {
	return "[" + strings.Repeat(number+",", n-1) + number + "]"
}

// A payload, metadata, a job's payload and a run's params are bounded as
// PostgreSQL stores them, not as they were sent: 900 KB of 1e308 (46 MB
// stored) is refused with its field named and writes nothing, in a
// submission, a batch, a jobs file, a trigger and a run; so are a batch
// and a jobs file whose entries are each within the bound but not
// together. A document
// within the bound as stored is taken.
func TestPayloadsAreBoundedAsStored(t *testing.T) {
	t.Parallel()
	// Each refusal reads and measures megabytes of JSON or YAML: about a
	// second apiece, several under the race detector on a loaded machine,
	// past the 5 s and 10 s the test server otherwise gives a request and
	// its response.
	b := setup(t, func(c *config.API) {
		c.RequestTimeout, c.ReadTimeout, c.WriteTimeout = time.Minute, time.Minute, 2*time.Minute
	})
	b.applied(t, "", diamondJobs)
	huge := bigNumbers("1e308", 150000) // 900 KB sent, 46 MB stored
	requireRefused := func(resp response, field string) {
		t.Helper()
		if !assert.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %.300s", field, resp.body) {
			return
		}
		problem := resp.json(t)
		assert.Equal(t, field, problem["field"], problem)
		assert.Contains(t, problem["detail"], "as stored", problem)
	}
	before := b.counts(t)
	jobsBefore := string(b.get(t, "/v1/jobs").body)

	requireRefused(b.post(t, "/v1/tasks", `{"type":"demo.noop","payload":{"n":`+huge+`}}`), "payload")
	requireRefused(b.post(t, "/v1/tasks", `{"type":"demo.noop","metadata":{"n":`+huge+`}}`), "metadata")
	requireRefused(b.post(t, "/v1/tasks/batch", `{"tasks":[{"type":"demo.noop"},{"type":"demo.noop","payload":{"n":`+huge+`}}]}`),
		"tasks[1].payload")
	requireRefused(b.post(t, "/v1/jobs/a/trigger", `{"payload":{"n":`+huge+`}}`), "payload")
	requireRefused(b.post(t, "/v1/workflows/diamond/runs", `{"params":{"n":`+huge+`}}`), "params")
	// A batch of entries each under the body limit by far and over the
	// bound as stored: 1e-16383 is 16385 bytes in PostgreSQL.
	tiny := `{"type":"demo.noop","dedupe":false,"payload":{"n":` + bigNumbers("1e-16383", 70) + `}}`
	requireRefused(b.post(t, "/v1/tasks/batch", `{"tasks":[`+tiny+`,`+tiny+`]}`), "tasks[0].payload")
	// Each entry within the bound, the batch not: 18 entries of 600
	// bytes each are 17.7 MB as stored.
	var entries []string
	for range 18 {
		entries = append(entries, `{"type":"demo.noop","dedupe":false,"payload":{"n":`+bigNumbers("1e-16383", 60)+`}}`)
	}
	batch := b.post(t, "/v1/tasks/batch", `{"tasks":[`+strings.Join(entries, ",")+`]}`)
	requireRefused(batch, "tasks")
	require.Contains(t, batch.json(t)["detail"], "for a batch")
	require.Equal(t, before, b.counts(t), "a refused submission writes nothing")
	var runs int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM workflow_runs`).Scan(&runs))
	require.Zero(t, runs, "a refused run starts nothing")

	file, err := json.Marshal(map[string]any{"jobs": []any{map[string]any{
		"name": "big", "type": "demo.noop", "payload": map[string]any{"n": json.RawMessage(huge)}}}})
	require.NoError(t, err)
	applied := b.apply(t, "", "application/json", string(file))
	require.Equal(t, http.StatusUnprocessableEntity, applied.status, "%.300s", applied.body)
	require.Contains(t, string(applied.body), "as stored")
	require.Contains(t, string(applied.body), "payload")
	require.Equal(t, jobsBefore, string(b.get(t, "/v1/jobs").body), "a refused file applies nothing")
	// Each job within the bound, the file not: a YAML alias repeats a
	// 500 KB payload 40 times, 20 MB as stored, from a file of 500 KB.
	var aliased strings.Builder
	aliased.WriteString("jobs:\n  - {name: j, type: demo.noop, payload: {x: &s \"" + strings.Repeat("x", 500000) + "\"}}\n")
	for i := range 40 {
		fmt.Fprintf(&aliased, "  - {name: j%d, type: demo.noop, payload: {x: *s}}\n", i)
	}
	applied = b.apply(t, "", "application/yaml", aliased.String())
	require.Equal(t, http.StatusUnprocessableEntity, applied.status, "%.300s", applied.body)
	problems := applied.json(t)["errors"].([]any)
	require.Len(t, problems, 1, problems)
	require.Equal(t, "jobs", problems[0].(map[string]any)["path"])
	require.Contains(t, problems[0].(map[string]any)["message"], "for a file")
	require.Equal(t, jobsBefore, string(b.get(t, "/v1/jobs").body), "a refused file applies nothing")

	// Within the bound as stored: taken, and answered as stored.
	fits := `{"n":` + bigNumbers("1e308", 3000) + `}`
	stored, err := task.StoredLen([]byte(fits))
	require.NoError(t, err)
	require.Less(t, stored, task.MaxPayloadBytes)
	resp := b.post(t, "/v1/tasks", `{"type":"demo.noop","payload":`+fits+`}`)
	require.Equal(t, http.StatusCreated, resp.status, "%.300s", resp.body)
	var length int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(),
		`SELECT octet_length(payload::text) FROM tasks WHERE id = $1`, resp.json(t)["id"]).Scan(&length))
	require.Equal(t, stored, length)
}
