package demo

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor"
)

type reports []int

func (r *reports) Progress(_ context.Context, percent int, _ string) error {
	*r = append(*r, percent)
	return nil
}

func (r *reports) Gather(context.Context, ...conveyor.Child) ([]conveyor.ChildResult, error) {
	return nil, errors.New("the demo handlers spawn no children")
}

func TestSleepReportsEachStepAndFailsAsAsked(t *testing.T) {
	t.Parallel()
	var r reports
	task := conveyor.Task{Payload: json.RawMessage(`{"steps": 4, "step_ms": 1, "fail_times": 1}`), Attempt: 1}
	_, err := Sleep(context.Background(), task, &r)
	require.ErrorContains(t, err, "failing attempt 1")
	require.False(t, conveyor.IsPermanent(err))
	require.Empty(t, r)

	task.Attempt = 2
	res, err := Sleep(context.Background(), task, &r)
	require.NoError(t, err)
	require.Equal(t, reports{25, 50, 75, 100}, r)
	require.Contains(t, res, "slept_ms")
}

func TestSleepStopsWhenCancelled(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(conveyor.ErrCancelled)
	var r reports
	_, err := Sleep(ctx, conveyor.Task{Payload: json.RawMessage(`{"steps": 1000, "step_ms": 1000}`), Attempt: 1}, &r)
	require.ErrorIs(t, err, conveyor.ErrCancelled)
	require.Empty(t, r)
}

func TestSleepRejectsBadPayloadPermanently(t *testing.T) {
	t.Parallel()
	for _, p := range []string{`[]`, `{"steps": -1}`, `{"steps": "x"}`} {
		_, err := Sleep(context.Background(), conveyor.Task{Payload: json.RawMessage(p), Attempt: 1}, new(reports))
		require.True(t, conveyor.IsPermanent(err), p)
	}
}
