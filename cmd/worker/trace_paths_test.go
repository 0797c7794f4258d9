package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"

	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// Every way a task comes to be is traced end to end, the api, relay and
// worker exporting to a real OTLP receiver: the trace the API names for the
// task holds the worker's CONSUMER span of its last attempt, under the
// relay's PRODUCER span of its message, under the span that made the task
// (a request's, the scheduler's cron pass, a failed attempt's retry, the
// parent's attempt for a child), the trace's root. The producer and
// consumer spans name the task's id, type and org; a request that makes or
// retries one task names it; a retry's request links to the traces it
// replaces.
func TestEveryWayATaskComesToBeIsTracedEndToEnd(t *testing.T) {
	skipShort(t)
	t.Parallel()
	otlp := testenv.NewOTLPReceiver(t)
	otel := []string{
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + otlp.Endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
		"OTEL_BSP_SCHEDULE_DELAY=100",
	}
	db := testdb.New(t)
	ctx := context.Background()
	b := setupWith(t, db.URL, db.Pool, testenv.NewVhost(t), otel...)

	// Submitted before any worker serves its type: its message is parked,
	// then released when the worker declares its queue.
	parked := b.sleepTask(t, 1, 1)
	testenv.Eventually(t, 20*time.Second, func() error {
		var n int
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE available_at = 'infinity'`).Scan(&n))
		if n == 0 {
			return fmt.Errorf("the message is not parked yet")
		}
		return nil
	})
	admin := testenv.FreeAddr(t)
	worker := b.startWorker(t, "w1", append(otel, "WORKER_ADMIN_ADDR="+admin, "RETRY_BACKOFF_BASE=10ms", "RETRY_BACKOFF_MAX=20ms",
		"LOG_LEVEL=debug")...)
	testenv.WaitHTTP(t, "http://"+admin+"/readyz", 30*time.Second)
	b.apply(t, `jobs:
  - {name: by-hand, type: demo.sleep, payload: {steps: 1, step_ms: 1}}
  - {name: every-second, type: demo.noop, source: {kind: cron, schedule: "* * * * * *", timezone: UTC}}
  - {name: first, type: demo.sleep, payload: {steps: 1, step_ms: 1}}
  - {name: second, type: demo.sleep, payload: {steps: 1, step_ms: 1}}
workflows:
  - name: pair
    nodes:
      - {job: first}
      - {job: second, depends_on: [first]}
`)
	type made struct {
		how  string
		id   uuid.UUID
		root string // the root span's service and name
	}
	var tasks []made
	api := func(name string) string { return "conveyor-api " + name }

	b.waitStatus(t, parked, "COMPLETED", 30*time.Second)
	tasks = append(tasks, made{"parked, then released", parked, api("POST /v1/tasks")})

	// An idempotent resubmission answers the first task, whose trace it names.
	dupBody := map[string]any{"type": "demo.sleep", "payload": map[string]any{"steps": 1, "step_ms": 1, "dup": true}}
	var first, again struct {
		ID      uuid.UUID `json:"id"`
		TraceID string    `json:"trace_id"`
	}
	require.NoError(t, json.Unmarshal(b.post(t, "/v1/tasks", dupBody, http.StatusCreated), &first))
	require.NoError(t, json.Unmarshal(b.post(t, "/v1/tasks", dupBody, http.StatusOK), &again))
	require.Equal(t, first, again, "the resubmission names the task and the trace it runs in")
	b.waitStatus(t, first.ID, "COMPLETED", 30*time.Second)
	tasks = append(tasks, made{"submitted, then resubmitted", first.ID, api("POST /v1/tasks")})

	var trig struct{ ID uuid.UUID }
	require.NoError(t, json.Unmarshal(b.post(t, "/v1/jobs/by-hand/trigger", nil, http.StatusCreated), &trig))
	b.waitStatus(t, trig.ID, "COMPLETED", 30*time.Second)
	tasks = append(tasks, made{"triggered by hand", trig.ID, api("POST /v1/jobs/{name}/trigger")})

	for _, id := range b.postBatch(t, []map[string]any{{"type": "demo.noop", "dedupe": false}, {"type": "demo.noop", "dedupe": false}}) {
		b.waitStatus(t, id, "COMPLETED", 30*time.Second)
		tasks = append(tasks, made{"submitted in a batch", id, api("POST /v1/tasks/batch")})
	}

	parent := b.submit(t, "demo.fanout", map[string]any{"children": 2, "child": map[string]any{"steps": 1, "step_ms": 1}}, 3)
	b.waitStatus(t, parent, "COMPLETED", 30*time.Second)
	tasks = append(tasks, made{"spawned by a handler", b.ids(t, `SELECT id FROM tasks WHERE parent_id = $1`, parent)[0], api("POST /v1/tasks")})

	var run struct{ ID uuid.UUID }
	require.NoError(t, json.Unmarshal(b.post(t, "/v1/workflows/pair/runs", map[string]any{}, http.StatusCreated), &run))
	testenv.Eventually(t, 30*time.Second, func() error {
		if n := len(b.ids(t, `SELECT id FROM tasks WHERE run_id = $1 AND status = 'COMPLETED'`, run.ID)); n != 2 {
			return fmt.Errorf("%d of the run's 2 nodes completed", n)
		}
		return nil
	})
	for _, id := range b.ids(t, `SELECT id FROM tasks WHERE run_id = $1`, run.ID) {
		tasks = append(tasks, made{"a workflow run's node", id, api("POST /v1/workflows/{name}/runs")})
	}

	var ticked []uuid.UUID
	testenv.Eventually(t, 30*time.Second, func() error {
		if ticked = b.ids(t, `SELECT id FROM tasks WHERE scheduled_at IS NOT NULL AND status = 'COMPLETED'`); len(ticked) == 0 {
			return fmt.Errorf("no cron task completed yet")
		}
		return nil
	})
	tasks = append(tasks, made{"fired by cron", ticked[0], "conveyor-worker cron"})

	retried := b.submit(t, "demo.sleep", map[string]any{"steps": 1, "step_ms": 1, "fail_times": 1}, 3)
	b.waitStatus(t, retried, "COMPLETED", 30*time.Second)
	tasks = append(tasks, made{"retried after a failure", retried, "conveyor-worker schedule retry"})

	// Retries through the API: one task, then two by a filter.
	// (A fan-out whose payload does not read fails for good, and is not
	// among the demo.sleep tasks the bulk retry's filter matches.)
	failed := b.submit(t, "demo.fanout", map[string]any{"children": "many"}, 1)
	b.waitStatus(t, failed, "FAILED", 30*time.Second)
	failedTrace := b.traceID(t, failed)
	b.post(t, "/v1/tasks/"+failed.String()+"/retry", nil, http.StatusOK)
	b.waitStatus(t, failed, "FAILED", 30*time.Second)
	tasks = append(tasks, made{"retried through the API", failed, api("POST /v1/tasks/{id}/retry")})
	var bulk []uuid.UUID
	var bulkTraces []string
	for i := range 2 {
		id := b.submit(t, "demo.sleep", map[string]any{"steps": 1, "step_ms": 1, "fail_times": 9, "i": i}, 1)
		b.waitStatus(t, id, "FAILED", 30*time.Second)
		bulk, bulkTraces = append(bulk, id), append(bulkTraces, b.traceID(t, id))
	}
	b.post(t, "/v1/tasks/retry", map[string]any{"filter": map[string]any{"status": "FAILED", "type": "demo.sleep"},
		"expected": 2}, http.StatusOK)
	for _, id := range bulk {
		b.waitStatus(t, id, "FAILED", 30*time.Second)
		tasks = append(tasks, made{"retried in bulk through the API", id, api("POST /v1/tasks/retry")})
	}

	for _, m := range tasks {
		var org, typ string
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT org_id::text, type FROM tasks WHERE id = $1`, m.id).Scan(&org, &typ))
		traceID := b.traceID(t, m.id)
		testenv.Eventually(t, 20*time.Second, func() error {
			spans := otlp.Trace(traceID)
			byID := map[string]testenv.Span{}
			for _, s := range spans {
				byID[s.SpanID] = s
			}
			var consumer testenv.Span
			for _, s := range spans {
				if s.Kind == tracepb.Span_SPAN_KIND_CONSUMER && s.Attributes["conveyor.task_id"] == m.id.String() {
					consumer = s
				}
			}
			producer, ok := byID[consumer.ParentSpanID]
			if consumer.SpanID == "" || !ok || producer.Kind != tracepb.Span_SPAN_KIND_PRODUCER {
				return fmt.Errorf("%s: no consumer span under a producer span in the task's trace: %s", m.how, describe(spans))
			}
			root := producer
			for root.ParentSpanID != "" {
				if root, ok = byID[root.ParentSpanID]; !ok {
					return fmt.Errorf("%s: a span's parent is not in the trace (yet): %s", m.how, describe(spans))
				}
			}
			if got := root.Service + " " + root.Name; got != m.root {
				return fmt.Errorf("%s: the trace's root is %q, want %q: %s", m.how, got, m.root, describe(spans))
			}
			for _, s := range []testenv.Span{producer, consumer} {
				for k, want := range map[string]string{"conveyor.task_id": m.id.String(), "conveyor.task_type": typ,
					"conveyor.org_id": org} {
					if s.Attributes[k] != want {
						return fmt.Errorf("%s: %s span %q has %s=%q, want %q", m.how, s.Service, s.Name, k, s.Attributes[k], want)
					}
				}
			}
			if root.Name != "cron" && root.Attributes["conveyor.org_id"] != org {
				return fmt.Errorf("%s: the root span %q names org %q, want %q", m.how, root.Name, root.Attributes["conveyor.org_id"], org)
			}
			if !slices.Contains([]string{"submitted in a batch", "retried in bulk through the API", "a workflow run's node",
				"spawned by a handler"}, m.how) && root.Service == "conveyor-api" && root.Attributes["conveyor.task_id"] != m.id.String() {
				return fmt.Errorf("%s: the request's span names task %q, want %s", m.how, root.Attributes["conveyor.task_id"], m.id)
			}
			switch m.how {
			case "retried through the API":
				if !slices.Equal(root.Links, []string{failedTrace}) {
					return fmt.Errorf("the retry's span links to %v, want the task's previous trace %s", root.Links, failedTrace)
				}
			case "retried in bulk through the API":
				if !slices.Contains(root.Links, bulkTraces[0]) || !slices.Contains(root.Links, bulkTraces[1]) {
					return fmt.Errorf("the bulk retry's span links to %v, want the tasks' previous traces %v", root.Links, bulkTraces)
				}
			case "spawned by a handler":
				// The child's message hangs under its parent's attempt.
				under := false
				for s := producer; s.ParentSpanID != "" && !under; s = byID[s.ParentSpanID] {
					p := byID[s.ParentSpanID]
					under = p.Kind == tracepb.Span_SPAN_KIND_CONSUMER && p.Attributes["conveyor.task_id"] == parent.String()
				}
				if !under {
					return fmt.Errorf("the child's producer span is not under its parent's consumer span: %s", describe(spans))
				}
			}
			return nil
		})
	}
	// The worker's log lines of a task carry the trace of its attempt, and
	// those of a failed attempt say why, retried or not.
	for _, id := range []uuid.UUID{retried, failed} {
		var lines, failures []string
		for _, line := range strings.Split(worker.Output(), "\n") {
			if strings.Contains(line, "task_id="+id.String()) {
				lines = append(lines, line)
				if strings.Contains(line, "msg=\"attempt failed;") && strings.Contains(line, "error=") {
					failures = append(failures, line)
				}
			}
		}
		require.NotEmpty(t, failures, "no log line says why an attempt of %s failed: %s", id, strings.Join(lines, "\n"))
		for _, line := range lines {
			require.Contains(t, line, "trace_id=", "a log line of a task without its trace")
		}
	}
}

// ids runs a query of task ids.
func (b *bundle) ids(t *testing.T, sql string, args ...any) []uuid.UUID {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), sql, args...)
	require.NoError(t, err)
	var out []uuid.UUID
	for rows.Next() {
		var id uuid.UUID
		require.NoError(t, rows.Scan(&id))
		out = append(out, id)
	}
	require.NoError(t, rows.Err())
	return out
}
