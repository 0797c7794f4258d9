package postgres_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// A batch is written by one statement, and still each of its tasks is
// gated, deduplicated and stamped on its own: a limited type's task waits
// beside an unlimited one that is queued at once, a repeated input writes
// one task, and each task keeps its own visibility, delay, timeout and
// event.
func TestOneBatchGatesEachTaskOnItsOwn(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, "types:\n  - type: batch.limited\n    max_concurrency: 1\n")

	sub := func(in task.SubmitInput) task.Submission {
		t.Helper()
		s, err := task.NewSubmission(in, task.Defaults{MaxAttempts: 3}, "")
		require.NoError(t, err)
		return s
	}
	subs := []task.Submission{
		sub(task.SubmitInput{Type: "batch.limited", Payload: []byte(`{"n":1}`)}),
		sub(task.SubmitInput{Type: "batch.free", Payload: []byte(`{"n":1}`), Visibility: []string{"ops"},
			Delay: "90s", TimeoutSeconds: 30}),
		sub(task.SubmitInput{Type: "batch.free", Payload: []byte(`{"n":1}`), Visibility: []string{"ops"},
			Delay: "90s", TimeoutSeconds: 30}),
		sub(task.SubmitInput{Type: "batch.free", Payload: []byte(`{"n":2}`)}),
	}
	before := time.Now()
	out, err := postgres.NewAPIStore(db.Pool, nil).SubmitBatch(ctx, admin, subs, task.Carrier{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
	require.NoError(t, err)
	require.Len(t, out, 4)
	require.Equal(t, []bool{true, true, false, true}, []bool{out[0].Created, out[1].Created, out[2].Created, out[3].Created})
	require.Equal(t, out[1].Task.ID, out[2].Task.ID, "the repeated input got the first one's task")

	limited, delayed, plain := out[0].Task, out[1].Task, out[3].Task
	require.False(t, limited.Admitted, "the limited type's task waits for the scheduler")
	require.Equal(t, task.StateWaiting, limited.State)
	require.True(t, delayed.Admitted)
	require.True(t, plain.Admitted)
	require.Equal(t, []string{"ops"}, delayed.Visibility)
	require.Empty(t, plain.Visibility)
	require.Equal(t, 30*time.Second, delayed.Timeout)
	require.Zero(t, plain.Timeout)
	require.WithinDuration(t, before.Add(90*time.Second), delayed.NextRunAt, 5*time.Second)
	require.WithinDuration(t, before, plain.NextRunAt, 5*time.Second)
	require.Equal(t, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", plain.Traceparent)

	// One event each, by the API for the admin, and a message for each
	// admitted task only.
	for _, c := range []struct {
		id      uuid.UUID
		message bool
	}{{limited.ID, false}, {delayed.ID, true}, {plain.ID, true}} {
		var events, messages int
		var actor string
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM task_events WHERE task_id = $1),
			(SELECT min(actor) FROM task_events WHERE task_id = $1),
			(SELECT count(*) FROM outbox WHERE task_id = $1 AND kind = 'task.run')`, c.id).Scan(&events, &actor, &messages))
		require.Equal(t, 1, events, "task %s", c.id)
		require.Equal(t, "API", actor)
		require.Equal(t, c.message, messages == 1, "task %s", c.id)
	}
	var tasks int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM tasks`).Scan(&tasks))
	require.Equal(t, 3, tasks)
}
