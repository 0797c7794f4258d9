package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testenv"
)

// apply posts a jobs file to the API and requires it to be applied.
func (b *bundle) apply(t *testing.T, file string) {
	t.Helper()
	resp, err := b.client.Post(b.api+"/v1/jobs/apply", "application/yaml", bytes.NewReader([]byte(file)))
	require.NoError(t, err)
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
}

// post posts JSON (or nothing) to path and requires status.
func (b *bundle) post(t *testing.T, path string, body any, status int) []byte {
	t.Helper()
	var r io.Reader = http.NoBody
	if body != nil {
		data, err := json.Marshal(body)
		require.NoError(t, err)
		r = bytes.NewReader(data)
	}
	resp, err := b.client.Post(b.api+path, "application/json", r)
	require.NoError(t, err)
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	require.Equal(t, status, resp.StatusCode, "%.500s", out)
	return out
}

// submitMany submits tasks of a type in batches and returns their ids.
func (b *bundle) submitMany(t *testing.T, typ string, payload map[string]any, n int, extra map[string]any) []uuid.UUID {
	t.Helper()
	var ids []uuid.UUID
	for len(ids) < n {
		var entries []map[string]any
		for i := len(ids); i < n && len(entries) < 500; i++ {
			e := map[string]any{"type": typ, "payload": payload, "dedupe": false}
			for k, v := range extra {
				e[k] = v
			}
			entries = append(entries, e)
		}
		ids = append(ids, b.postBatch(t, entries)...)
	}
	return ids
}

// postBatch submits entries in one batch and returns their tasks' ids, in
// the entries' order.
func (b *bundle) postBatch(t *testing.T, entries []map[string]any) []uuid.UUID {
	t.Helper()
	var out struct {
		Results []struct {
			Task struct {
				ID uuid.UUID `json:"id"`
			} `json:"task"`
		} `json:"results"`
	}
	require.NoError(t, json.Unmarshal(b.post(t, "/v1/tasks/batch", map[string]any{"tasks": entries}, http.StatusOK), &out))
	require.Len(t, out.Results, len(entries))
	ids := make([]uuid.UUID, len(out.Results))
	for i, r := range out.Results {
		ids[i] = r.Task.ID
	}
	return ids
}

// waitAllDone waits until no task of typ is PENDING or IN_PROGRESS.
func (b *bundle) waitAllDone(t *testing.T, typ string, timeout time.Duration) {
	t.Helper()
	testenv.Eventually(t, timeout, func() error {
		var open int
		require.NoError(t, b.pool.QueryRow(context.Background(),
			`SELECT count(*) FROM tasks WHERE type = $1 AND status IN ('PENDING', 'IN_PROGRESS')`, typ).Scan(&open))
		if open > 0 {
			return fmt.Errorf("%d tasks of %s still open", open, typ)
		}
		return nil
	})
}

// A cron job ticking every second, on three workers whose maintenance
// leader is SIGKILLed twice, makes exactly one task per tick: none missing
// across the failovers, none twice.
func TestCronMakesOneTaskPerTickAcrossLeaderKills(t *testing.T) {
	b := setup(t)
	live := map[string]*testenv.Process{}
	for _, id := range []string{"w1", "w2", "w3"} {
		live[id] = b.startWorker(t, id)
	}
	b.apply(t, `jobs:
  - name: heartbeat
    type: demo.noop
    source: {kind: cron, schedule: "@every 1s"}
`)
	ctx := context.Background()
	leader := func() string {
		var id string
		testenv.Eventually(t, 30*time.Second, func() error {
			return b.pool.QueryRow(ctx, `SELECT leader_id FROM leaders WHERE name = 'maintenance' AND expires_at > now()`).Scan(&id)
		})
		return id
	}
	for i, next := range []string{"w4", "w5"} {
		time.Sleep(20 * time.Second)
		id := leader()
		t.Logf("kill %d: SIGKILL leader %s", i+1, id)
		live[id].Signal(syscall.SIGKILL)
		live[id].Wait(t, 10*time.Second)
		delete(live, id)
		live[next] = b.startWorker(t, next)
	}
	time.Sleep(20 * time.Second)
	b.post(t, "/v1/jobs/heartbeat/pause", nil, http.StatusOK)
	b.waitAllDone(t, "demo.noop", 60*time.Second)

	rows, err := b.pool.Query(ctx, `SELECT scheduled_at, status FROM tasks WHERE job_id IS NOT NULL ORDER BY scheduled_at`)
	require.NoError(t, err)
	var ticks []time.Time
	for rows.Next() {
		var at time.Time
		var status string
		require.NoError(t, rows.Scan(&at, &status))
		require.Equal(t, "COMPLETED", status, "tick %s", at)
		ticks = append(ticks, at)
	}
	require.NoError(t, rows.Err())
	require.GreaterOrEqual(t, len(ticks), 55, "a minute of ticks")
	for i := 1; i < len(ticks); i++ {
		require.Equal(t, time.Second, ticks[i].Sub(ticks[i-1]), "ticks %s and %s: one missing or doubled", ticks[i-1], ticks[i])
	}
	var terminal int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM task_events e JOIN tasks t ON t.id = e.task_id
		WHERE t.job_id IS NOT NULL AND e.status = 'COMPLETED'`).Scan(&terminal))
	require.Equal(t, len(ticks), terminal, "each tick's task completed once")
	t.Logf("%d ticks from %s to %s, one task each", len(ticks), ticks[0].Format(time.TimeOnly), ticks[len(ticks)-1].Format(time.TimeOnly))
}

// A type limited to 2 at once, with 200 tasks on three workers of 4 slots
// each, never runs more than 2 (from the events' times), while another
// type's tasks submitted after them run at once.
func TestConcurrencyLimitHoldsAcrossWorkers(t *testing.T) {
	b := setup(t)
	for _, id := range []string{"w1", "w2", "w3"} {
		b.startWorker(t, id)
	}
	b.apply(t, `types:
  - type: demo.sleep
    max_concurrency: 2
`)
	limited := b.submitMany(t, "demo.sleep", map[string]any{"steps": 1, "step_ms": 20}, 200, nil)
	other := b.submitMany(t, "demo.noop", nil, 100, nil)
	otherSubmitted := time.Now()
	b.waitAllDone(t, "demo.noop", 60*time.Second)
	otherDone := time.Since(otherSubmitted)
	b.waitAllDone(t, "demo.sleep", 3*time.Minute)

	ctx := context.Background()
	type edge struct {
		at    time.Time
		delta int
	}
	var edges []edge
	rows, err := b.pool.Query(ctx, `SELECT e.created_at, e.status FROM task_events e
		WHERE e.task_id = ANY ($1) AND (e.status = 'IN_PROGRESS' AND e.state = 'Running' OR e.status IN ('COMPLETED', 'FAILED', 'CANCELLED'))`, limited)
	require.NoError(t, err)
	completed := 0
	for rows.Next() {
		var at time.Time
		var status string
		require.NoError(t, rows.Scan(&at, &status))
		if status == "IN_PROGRESS" {
			edges = append(edges, edge{at, +1})
		} else {
			edges = append(edges, edge{at, -1})
			completed++
		}
	}
	require.NoError(t, rows.Err())
	require.Equal(t, len(limited), completed)
	sort.Slice(edges, func(i, j int) bool {
		if !edges[i].at.Equal(edges[j].at) {
			return edges[i].at.Before(edges[j].at)
		}
		return edges[i].delta < edges[j].delta // an end before a start at the same instant
	})
	running, most := 0, 0
	for _, e := range edges {
		running += e.delta
		most = max(most, running)
	}
	var gaps []time.Duration
	var lastEnd time.Time
	for _, e := range edges {
		if e.delta < 0 {
			lastEnd = e.at
		} else if !lastEnd.IsZero() {
			gaps = append(gaps, e.at.Sub(lastEnd))
		}
	}
	sort.Slice(gaps, func(i, j int) bool { return gaps[i] < gaps[j] })
	if len(gaps) > 0 {
		t.Logf("a freed slot to the next start: p50 %s, p90 %s", gaps[len(gaps)/2], gaps[len(gaps)*9/10])
	}
	require.LessOrEqual(t, most, 2, "never more than the limit running at once")
	require.Equal(t, 2, most, "the limit's two slots were used")

	var lastLimited time.Time
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT max(completed_at) FROM tasks WHERE id = ANY ($1)`, limited).Scan(&lastLimited))
	var lastOther time.Time
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT max(completed_at) FROM tasks WHERE id = ANY ($1)`, other).Scan(&lastOther))
	require.True(t, lastOther.Before(lastLimited), "the other type finished (at %s) before the limited backlog (at %s)", lastOther, lastLimited)
	t.Logf("limited: 200 tasks, at most %d at once, done at %s; other type: 100 tasks done %s after submission",
		most, lastLimited.Format(time.TimeOnly), otherDone)
}

// Pausing a type holds its new tasks (running ones finish); resuming lets
// them run. A job's execution timeout fails an attempt that runs too long;
// its heartbeat timeout fails an attempt whose handler goes silent, and
// spares one that keeps reporting.
func TestPauseTypeAndJobTimeout(t *testing.T) {
	b := setup(t)
	b.startWorker(t, "w1")
	b.post(t, "/v1/types/demo.sleep/pause", nil, http.StatusOK)
	id := b.sleepTask(t, 1, 10)
	time.Sleep(2 * time.Second)
	r := b.task(t, id)
	require.Equal(t, "PENDING", r.Status, "a paused type's task waits")
	b.post(t, "/v1/types/demo.sleep/resume", nil, http.StatusOK)
	b.waitStatus(t, id, "COMPLETED", 30*time.Second)

	b.apply(t, `jobs:
  - name: slow
    type: demo.sleep
    payload: {steps: 10, step_ms: 1000}
    max_attempts: 1
    timeout_seconds: 1
  - name: silent
    type: demo.sleep
    payload: {steps: 2, step_ms: 5000}
    max_attempts: 1
    heartbeat_timeout_seconds: 2
  - name: chatty
    type: demo.sleep
    payload: {steps: 8, step_ms: 500}
    max_attempts: 1
    heartbeat_timeout_seconds: 2
`)
	trigger := func(name string) uuid.UUID {
		var created struct {
			ID uuid.UUID `json:"id"`
		}
		require.NoError(t, json.Unmarshal(b.post(t, "/v1/jobs/"+name+"/trigger", nil, http.StatusCreated), &created))
		return created.ID
	}
	slow, silent, chatty := trigger("slow"), trigger("silent"), trigger("chatty")
	r = b.waitStatus(t, slow, "FAILED", 30*time.Second)
	require.Contains(t, r.Error, "timed out after 1s")
	r = b.waitStatus(t, silent, "FAILED", 30*time.Second)
	require.Contains(t, r.Error, "heartbeat timed out")
	b.waitStatus(t, chatty, "COMPLETED", 30*time.Second)
	b.requireOneTerminal(t, silent)
}
