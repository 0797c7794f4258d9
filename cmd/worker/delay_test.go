package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// A delayed task runs when it is due, not before, and its schedule lives in
// the database: a worker killed meanwhile changes nothing.
func TestDelayedTaskRunsWhenDueAcrossAWorkerRestart(t *testing.T) {
	b := setup(t)
	first := b.startWorker(t, "w1")

	body, err := json.Marshal(map[string]any{"type": "demo.sleep", "payload": map[string]any{"steps": 1, "step_ms": 10},
		"delay": "3s", "dedupe": false})
	require.NoError(t, err)
	resp, err := b.client.Post(b.api+"/v1/tasks", "application/json", bytes.NewReader(body))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	var created struct {
		ID        uuid.UUID `json:"id"`
		NextRunAt time.Time `json:"next_run_at"`
		CreatedAt time.Time `json:"created_at"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&created))
	require.InDelta(t, 3*time.Second, created.NextRunAt.Sub(created.CreatedAt), float64(200*time.Millisecond),
		"due three seconds after it was stored")

	first.Signal(syscall.SIGKILL)
	first.Wait(t, 10*time.Second)
	b.startWorker(t, "w2")

	b.waitStatus(t, created.ID, "COMPLETED", 30*time.Second)
	var startedAt, nextRunAt time.Time
	require.NoError(t, b.pool.QueryRow(context.Background(),
		`SELECT started_at, next_run_at FROM tasks WHERE id = $1`, created.ID).Scan(&startedAt, &nextRunAt))
	require.False(t, startedAt.Before(nextRunAt), "started at %s, before it was due at %s", startedAt, nextRunAt)
	require.Less(t, startedAt.Sub(nextRunAt), 2*time.Second, "started within the relay's poll of its due time")
	t.Logf("started %s after it was due", startedAt.Sub(nextRunAt))
}
