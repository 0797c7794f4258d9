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

	// A run_at in the past means now: the task is due from its submission,
	// not from the time a client's zero value names.
	for _, past := range []string{"0001-01-01T00:00:00Z", "2000-01-01T00:00:00Z"} {
		resp := b.post(t, "/v1/tasks", `{"type":"delay.past","payload":{},"dedupe":false,"run_at":"`+past+`"}`)
		require.Equal(t, http.StatusCreated, resp.status, string(resp.body))
		got := resp.json(t)
		require.Equal(t, got["created_at"], got["next_run_at"], "run_at %s", past)
	}

	// A run_at that is no RFC 3339 time is the field's mistake, as a delay
	// that is no duration is: a 422 naming it, not a malformed body.
	for _, c := range []struct{ path, body, field string }{
		{"/v1/tasks", `{"type":"delay.bad","payload":{},"delay":"soon"}`, "delay"},
		{"/v1/tasks", `{"type":"delay.bad","payload":{},"delay":"1s","run_at":"2026-01-01T00:00:00Z"}`, "delay"},
		{"/v1/tasks", `{"type":"delay.bad","payload":{},"run_at":"tomorrow"}`, "run_at"},
		{"/v1/tasks", `{"type":"delay.bad","payload":{},"run_at":1767225600}`, "run_at"},
		{"/v1/tasks/batch", `{"tasks":[{"type":"delay.bad","payload":{},"run_at":"2026-01-01 00:00:00"}]}`, "tasks.0.run_at"},
	} {
		resp := b.post(t, c.path, c.body)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", c.body, resp.body)
		require.Equal(t, c.field, resp.json(t)["field"], "%s: %s", c.body, resp.body)
	}
	resp := b.post(t, "/v1/tasks", `{"type":"delay.null","payload":{},"run_at":null}`)
	require.Equal(t, http.StatusCreated, resp.status, "a null run_at is none: %s", resp.body)
	var bad int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM tasks WHERE type = 'delay.bad'`).Scan(&bad))
	require.Zero(t, bad, "a refused submission writes nothing")
}
