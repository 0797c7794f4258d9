package main

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// A task of priority 9 submitted behind a backlog of 600 tasks of priority
// 0, queued in the broker, starts before all but a few of those still
// queued: the relay publishes it with its priority and the broker hands it
// out first. Only what the worker already holds (its slots and its
// read-ahead) goes before it. Fair mode is off here (the window is
// larger than the backlog): in fair mode the task would wait in PostgreSQL
// for the next pass, which admits it past the less urgent queued tasks,
// as the README says under "Priorities".
func TestHigherPriorityOvertakesTheQueuedBacklog(t *testing.T) {
	skipShort(t)
	t.Parallel()
	db := testdb.New(t)
	// Unpacked, so that the backlog and the urgent task share one queue
	// (a packed backlog has a queue of its own, which a worker consumes
	// beside the other, whatever the priorities).
	b := setupWith(t, db.URL, db.Pool, testenv.NewVhost(t), "AMQP_TASKS_PER_MESSAGE=1")
	b.startWorker(t, "w1", "WORKER_CONCURRENCY=4", "ADMISSION_WINDOW=1000000", "AMQP_TASKS_PER_MESSAGE=1")
	var low []map[string]any
	for range 300 {
		low = append(low, map[string]any{"type": "demo.sleep", "payload": map[string]any{"steps": 1, "step_ms": 50},
			"dedupe": false, "priority": 0})
	}
	var backlog []uuid.UUID
	for range 2 {
		backlog = append(backlog, b.postBatch(t, low)...)
	}
	// The backlog is queued, and the worker busy with it.
	testenv.Eventually(t, 30*time.Second, func() error {
		var started bool
		require.NoError(t, b.pool.QueryRow(context.Background(),
			`SELECT EXISTS (SELECT 1 FROM tasks WHERE id = ANY($1) AND started_at IS NOT NULL)`, backlog).Scan(&started))
		if !started {
			return errors.New("no task of the backlog started yet")
		}
		return nil
	})
	var high struct {
		ID uuid.UUID `json:"id"`
	}
	require.NoError(t, json.Unmarshal(b.post(t, "/v1/tasks", map[string]any{"type": "demo.sleep",
		"payload": map[string]any{"steps": 1, "step_ms": 20}, "dedupe": false, "priority": 9}, http.StatusCreated), &high))
	b.waitStatus(t, high.ID, "COMPLETED", 60*time.Second)

	var before, overtaken int
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT
		count(*) FILTER (WHERE t.started_at < h.created_at),
		count(*) FILTER (WHERE t.started_at >= h.created_at AND t.started_at < h.started_at)
		FROM tasks t, tasks h WHERE h.id = $1 AND t.id = ANY($2)`, high.ID, backlog).Scan(&before, &overtaken))
	t.Logf("of the backlog: %d started before the urgent task was submitted, %d between its submission and its start",
		before, overtaken)
	require.Less(t, before, len(backlog)-200, "the backlog was still queued when the urgent task came")
	require.Less(t, overtaken, 100, "the urgent task went ahead of the backlog still queued")
}
