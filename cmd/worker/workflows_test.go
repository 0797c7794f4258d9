package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testenv"
)

// A diamond workflow (a → b, c → d) run 100 times at once while workers
// are SIGKILLed and replaced: every node of every run completes exactly
// once, d always after b and c (and b, c after a), and no run is left
// behind.
func TestDiamondRunsSurviveWorkerKills(t *testing.T) {
	b := setup(t)
	live := map[string]*testenv.Process{}
	for _, id := range []string{"w1", "w2", "w3"} {
		live[id] = b.startWorker(t, id)
	}
	b.apply(t, `jobs:
  - {name: a, type: demo.sleep, payload: {steps: 4, step_ms: 50}}
  - {name: b, type: demo.sleep, payload: {steps: 4, step_ms: 50}}
  - {name: c, type: demo.sleep, payload: {steps: 4, step_ms: 50}}
  - {name: d, type: demo.sleep, payload: {steps: 4, step_ms: 50}}
workflows:
  - name: diamond
    nodes:
      - {job: a}
      - {job: b, depends_on: [a]}
      - {job: c, depends_on: [a]}
      - {job: d, depends_on: [b, c]}
`)
	const runs = 100
	var wg sync.WaitGroup
	for i := range runs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			b.post(t, "/v1/workflows/diamond/runs", map[string]any{"params": map[string]int{"i": i}}, http.StatusCreated)
		}()
	}
	wg.Wait()

	ctx := context.Background()
	for i, next := range []string{"w4", "w5", "w6"} {
		time.Sleep(2500 * time.Millisecond)
		victim := fmt.Sprintf("w%d", i+1)
		t.Logf("SIGKILL %s", victim)
		live[victim].Signal(syscall.SIGKILL)
		live[victim].Wait(t, 10*time.Second)
		live[next] = b.startWorker(t, next)
	}
	testenv.Eventually(t, 180*time.Second, func() error {
		var running int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM workflow_runs WHERE status = 'RUNNING'`).Scan(&running))
		if running > 0 {
			return fmt.Errorf("%d runs still running", running)
		}
		return nil
	})

	var completed int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM workflow_runs WHERE status = 'COMPLETED'`).Scan(&completed))
	require.Equal(t, runs, completed, "every run completed")

	// One task per node of each run, completed once (one COMPLETED event).
	rows, err := b.pool.Query(ctx, `
		SELECT t.run_id, t.node, t.status,
			(SELECT min(e.id) FROM task_events e WHERE e.task_id = t.id),
			coalesce((SELECT max(e.id) FROM task_events e WHERE e.task_id = t.id AND e.status = 'COMPLETED'), 0),
			(SELECT count(*) FROM task_events e WHERE e.task_id = t.id AND e.status = 'COMPLETED')
		FROM tasks t WHERE t.run_id IS NOT NULL`)
	require.NoError(t, err)
	// Event ids order what happened: a child's submission is written
	// after its parent's completion committed (the run's row lock waits for
	// it), so its first event comes after the parent's COMPLETED one.
	type node struct {
		submitted, completed int64
	}
	graph := map[uuid.UUID]map[string]node{}
	for rows.Next() {
		var run uuid.UUID
		var name, status string
		var n node
		var completions int
		require.NoError(t, rows.Scan(&run, &name, &status, &n.submitted, &n.completed, &completions))
		require.Equal(t, "COMPLETED", status, "run %s node %s", run, name)
		require.Equal(t, 1, completions, "run %s node %s completed once", run, name)
		if graph[run] == nil {
			graph[run] = map[string]node{}
		}
		_, twice := graph[run][name]
		require.False(t, twice, "run %s has two tasks for node %s", run, name)
		graph[run][name] = n
	}
	require.NoError(t, rows.Err())
	require.Len(t, graph, runs)
	for run, nodes := range graph {
		require.Len(t, nodes, 4, "run %s", run)
		for _, edge := range [][2]string{{"a", "b"}, {"a", "c"}, {"b", "d"}, {"c", "d"}} {
			parent, child := nodes[edge[0]], nodes[edge[1]]
			require.Greater(t, child.submitted, parent.completed,
				"run %s: %s submitted (event %d) before %s completed (event %d)", run, edge[1], child.submitted, edge[0], parent.completed)
		}
	}
}

// A handler that spawns 20 children waits for them without a worker slot,
// runs again when the last one finishes, and completes with their results,
// though a worker is SIGKILLed meanwhile.
func TestFanoutGathersChildrenAcrossAKill(t *testing.T) {
	b := setup(t)
	workers := map[string]*testenv.Process{
		"w1": b.startWorker(t, "w1", "WORKER_CONCURRENCY=2"),
		"w2": b.startWorker(t, "w2", "WORKER_CONCURRENCY=2"),
	}
	parent := b.submit(t, "demo.fanout", map[string]any{"children": 20, "child": map[string]int{"steps": 10, "step_ms": 100}}, 3)
	ctx := context.Background()
	// The kill lands on a worker running a child, early in its second
	// (whichever worker that is: one may have read every child ahead): a
	// kill of a worker with nothing to do would prove nothing.
	var victim string
	testenv.Eventually(t, 30*time.Second, func() error {
		err := b.pool.QueryRow(ctx, `SELECT worker_id FROM tasks WHERE parent_id = $1 AND worker_id IN ('w1', 'w2')
			AND status = 'IN_PROGRESS' AND progress <= 30 LIMIT 1`, parent).Scan(&victim)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("no worker runs a child yet")
		}
		require.NoError(t, err)
		return nil
	})
	workers[victim].Signal(syscall.SIGKILL)
	workers[victim].Wait(t, 10*time.Second)
	b.startWorker(t, "w3", "WORKER_CONCURRENCY=2")

	testenv.Eventually(t, 90*time.Second, func() error {
		var status string
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT status FROM tasks WHERE id = $1`, parent).Scan(&status))
		if status != "COMPLETED" {
			return fmt.Errorf("parent is %s", status)
		}
		return nil
	})
	var children, done int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE status = 'COMPLETED') FROM tasks WHERE parent_id = $1`,
		parent).Scan(&children, &done))
	require.Equal(t, 20, children, "each child spawned once, however often the parent ran")
	require.Equal(t, 20, done)
	var result []byte
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT payload FROM task_results WHERE task_id = $1`, parent).Scan(&result))
	var out struct {
		Completed int `json:"completed"`
		Failed    int `json:"failed"`
	}
	require.NoError(t, json.Unmarshal(result, &out))
	require.Equal(t, 20, out.Completed)
	require.Zero(t, out.Failed)
	var waited int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM task_events WHERE task_id = $1 AND state = 'Waiting for children'`,
		parent).Scan(&waited))
	require.Positive(t, waited, "the parent waited for its children")
	var rerun int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE parent_id = $1 AND attempt > 1`, parent).Scan(&rerun))
	require.Positive(t, rerun, "a child the kill interrupted ran again")
}
