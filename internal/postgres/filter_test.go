package postgres_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// fixture is a task as a filter sees it.
type fixture struct {
	id       uuid.UUID
	typ      string
	status   task.Status
	created  time.Time
	metadata map[string]any
}

// matches is the filter's meaning, in Go.
func matches(f task.Filter, x fixture) bool {
	meta, ok := x.metadata[f.MetaKey]
	return (f.Status == "" || x.status == f.Status) && (f.Type == "" || x.typ == f.Type) &&
		(f.CreatedAfter.IsZero() || !x.created.Before(f.CreatedAfter)) &&
		(f.CreatedBefore.IsZero() || x.created.Before(f.CreatedBefore)) &&
		(f.ID == uuid.Nil || x.id == f.ID) &&
		(f.MetaKey == "" || ok && fmt.Sprint(meta) == f.MetaValue)
}

// Every shape of the filter statements (each filter set or not) runs, and
// selects what the filter means: a listing lists, and a bulk dry run
// counts, exactly the tasks the same filter selects in Go.
func TestEveryFilterShapeSelectsWhatItMeans(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	store := postgres.NewAPIStore(db.Pool, nil)
	_, admin := db.Admin(t)
	now := time.Now().UTC().Truncate(time.Second)

	tasks := []fixture{
		{typ: "f.a", status: task.StatusPending, created: now.Add(-3 * time.Hour), metadata: map[string]any{"team": "x"}},
		{typ: "f.b", status: task.StatusPending, created: now.Add(-2 * time.Hour), metadata: map[string]any{"team": "y", "n": 5}},
		{typ: "f.a", status: task.StatusFailed, created: now.Add(-time.Hour), metadata: map[string]any{}},
		{typ: "f.a", status: task.StatusCancelled, created: now, metadata: map[string]any{"team": "x"}},
		{typ: "f.b", status: task.StatusInProgress, created: now, metadata: map[string]any{"team": "x"}},
	}
	for i := range tasks {
		meta, err := json.Marshal(tasks[i].metadata)
		require.NoError(t, err)
		sub, err := task.NewSubmission(task.SubmitInput{Type: tasks[i].typ, Payload: json.RawMessage(fmt.Sprintf(`{"i":%d}`, i)),
			Metadata: meta}, task.Defaults{MaxAttempts: 3}, "")
		require.NoError(t, err)
		res, err := store.Submit(ctx, admin, sub, nil)
		require.NoError(t, err)
		tasks[i].id = res.Task.ID
		_, err = db.Pool.Exec(ctx, `UPDATE tasks SET status = $2, created_at = $3,
			completed_at = CASE WHEN $2 IN ('FAILED', 'CANCELLED') THEN now() END,
			lease_expires_at = CASE WHEN $2 = 'IN_PROGRESS' THEN now() + interval '1 minute' END WHERE id = $1`,
			tasks[i].id, string(tasks[i].status), tasks[i].created)
		require.NoError(t, err)
	}

	type meta struct{ key, value string }
	shapes := 0
	for _, status := range []task.Status{"", task.StatusPending, task.StatusFailed} {
		for _, typ := range []string{"", "f.a"} {
			for _, after := range []time.Time{{}, now.Add(-150 * time.Minute)} {
				for _, before := range []time.Time{{}, now.Add(-30 * time.Minute)} {
					for _, id := range []uuid.UUID{uuid.Nil, tasks[1].id} {
						for _, m := range []meta{{}, {"team", "x"}, {"n", "5"}} {
							shapes++
							f := task.Filter{Status: status, Type: typ, CreatedAfter: after, CreatedBefore: before, ID: id,
								MetaKey: m.key, MetaValue: m.value}
							var want []uuid.UUID
							for _, x := range tasks {
								if matches(f, x) {
									want = append(want, x.id)
								}
							}
							slices.SortFunc(want, func(a, b uuid.UUID) int { return strings.Compare(b.String(), a.String()) })
							got, err := store.List(ctx, admin, task.ListFilter{Filter: f, Limit: 100})
							require.NoError(t, err, "%+v", f)
							ids := []uuid.UUID{}
							for _, tk := range got {
								ids = append(ids, tk.ID)
							}
							require.Equal(t, append([]uuid.UUID{}, want...), ids, "%+v", f)

							for _, action := range []task.Action{task.ActionCancel, task.ActionRetry} {
								res, err := store.Bulk(ctx, admin, task.Bulk{Action: action, Filter: f, DryRun: true, Limit: 10}, nil)
								if _, narrowErr := action.Narrow(status); narrowErr != nil {
									require.Equal(t, task.ErrCodeInvalid, task.ErrorCode(err))
									continue
								}
								require.NoError(t, err, "%s %+v", action, f)
								n := 0
								for _, x := range tasks {
									if matches(f, x) && x.status.In(action.Statuses()) {
										n++
									}
								}
								require.Equal(t, task.BulkResult{Matched: n}, res, "%s %+v", action, f)
							}
						}
					}
				}
			}
		}
	}
	require.Equal(t, 144, shapes)
}

// A task that moves on between a bulk action's read and its write is
// skipped and counted as such: each change is fenced by the version read,
// and a task read again in another status is left alone.
func TestBulkSkipsATaskThatChangedMeanwhile(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	store := postgres.NewAPIStore(db.Pool, nil)
	_, admin := db.Admin(t)
	a, b, c := submit(t, store, admin, `{"n":1}`), submit(t, store, admin, `{"n":2}`), submit(t, store, admin, `{"n":3}`)

	// Another writer holds b's row and is about to end it.
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `UPDATE tasks SET status = 'FAILED', state = 'Failed', completed_at = now(),
		version = version + 1 WHERE id = $1`, b.ID)
	require.NoError(t, err)

	type outcome struct {
		res task.BulkResult
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := store.Bulk(ctx, admin, task.Bulk{Action: task.ActionCancel, Limit: task.MaxBulkLimit}, nil)
		done <- outcome{res, err}
	}()
	// The bulk action has read the versions and waits for b's lock.
	db.WaitForLockWait(t)
	require.NoError(t, tx.Commit(ctx))

	got := <-done
	require.NoError(t, got.err)
	require.Equal(t, task.BulkResult{Matched: 3, Changed: 2, Skipped: 1}, got.res)
	for id, want := range map[uuid.UUID]task.Status{a.ID: task.StatusCancelled, b.ID: task.StatusFailed, c.ID: task.StatusCancelled} {
		tk, err := store.Get(ctx, admin, id)
		require.NoError(t, err)
		require.Equal(t, want, tk.Status)
	}
}
