package task_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/task"
)

// A bulk action covers exactly the statuses its transitions start from, and
// picks for each task what the single-task endpoint would.
func TestBulkActionsFollowTheLifecycle(t *testing.T) {
	t.Parallel()
	require.Equal(t, []task.Status{task.StatusPending, task.StatusInProgress}, task.ActionCancel.Statuses())
	require.Equal(t, []task.Status{task.StatusFailed, task.StatusCancelled}, task.ActionRetry.Statuses())

	for _, tt := range []struct {
		action        task.Action
		status        task.Status
		cancelPending bool
		want          task.Transition
		conflict      bool
	}{
		{task.ActionCancel, task.StatusPending, false, task.CancelPending, false},
		{task.ActionCancel, task.StatusInProgress, false, task.RequestCancel, false},
		{task.ActionCancel, task.StatusInProgress, true, "", false},
		{task.ActionCancel, task.StatusCompleted, false, "", true},
		{task.ActionRetry, task.StatusFailed, false, task.Retry, false},
		{task.ActionRetry, task.StatusCancelled, true, task.Retry, false},
		{task.ActionRetry, task.StatusPending, false, "", true},
	} {
		tr, err := tt.action.Decide(tt.status, tt.cancelPending)
		require.Equal(t, tt.want, tr, "%s %s", tt.action, tt.status)
		if tt.conflict {
			require.Equal(t, task.ErrCodeConflict, task.ErrorCode(err))
		} else {
			require.NoError(t, err)
		}
	}

	all, err := task.ActionRetry.Narrow("")
	require.NoError(t, err)
	require.Equal(t, task.ActionRetry.Statuses(), all)
	one, err := task.ActionCancel.Narrow(task.StatusInProgress)
	require.NoError(t, err)
	require.Equal(t, []task.Status{task.StatusInProgress}, one)
	_, err = task.ActionRetry.Narrow(task.StatusPending)
	require.Equal(t, task.ErrCodeInvalid, task.ErrorCode(err), "a retry never applies to a PENDING task")
}
