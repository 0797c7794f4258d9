package main

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestSubmitWithRunAtOrDelay(t *testing.T) {
	t.Parallel()
	b := setup(t)
	at := time.Now().Add(time.Hour).UTC().Truncate(time.Second)

	single := b.post(t, "/v1/tasks", `{"type":"delay.at","payload":{},"run_at":"`+at.Format(time.RFC3339)+`"}`)
	require.Equal(t, http.StatusCreated, single.status, string(single.body))
	due, err := time.Parse(time.RFC3339Nano, single.json(t)["next_run_at"].(string))
	require.NoError(t, err)
	require.True(t, at.Equal(due), "due at %s, asked for %s", due, at)

	batch := b.post(t, "/v1/tasks/batch", `{"tasks":[{"type":"delay.batch","payload":{},"delay":"90m"}]}`)
	require.Equal(t, http.StatusOK, batch.status, string(batch.body))

	// The outbox message waits too: nothing is published before it is due.
	var waiting int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox o JOIN tasks t ON t.id = o.task_id
		WHERE t.type IN ('delay.at', 'delay.batch') AND o.available_at = t.next_run_at AND t.next_run_at > now() + interval '59 minutes'`).Scan(&waiting))
	require.Equal(t, 2, waiting)

	for body, want := range map[string]int{
		`{"type":"delay.bad","payload":{},"delay":"soon"}`:                               http.StatusUnprocessableEntity,
		`{"type":"delay.bad","payload":{},"delay":"1s","run_at":"2026-01-01T00:00:00Z"}`: http.StatusUnprocessableEntity,
		`{"type":"delay.bad","payload":{},"run_at":"tomorrow"}`:                          http.StatusBadRequest,
	} {
		resp := b.post(t, "/v1/tasks", body)
		require.Equal(t, want, resp.status, "%s: %s", body, resp.body)
	}
	var bad int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM tasks WHERE type = 'delay.bad'`).Scan(&bad))
	require.Zero(t, bad, "a refused submission writes nothing")
}
