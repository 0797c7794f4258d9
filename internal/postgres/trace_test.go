package postgres_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// A task retried through the API takes the retrying request's trace, as a
// retry after a failure takes a new one; the task then names that trace
// only. The request's span links to the trace the task had, where its
// failed attempts are, as the worker's retry span links to the failed
// attempt's: otherwise nothing leads back to them.
func TestRetryLinksToTheTasksPreviousTrace(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	store := postgres.NewAPIStore(db.Pool, nil)
	_, admin := db.Admin(t)
	const original = "4bf92f3577b34da6a3ce929d0e0e4736"
	sub, err := task.NewSubmission(task.SubmitInput{Type: "retry.traced", Payload: json.RawMessage(`{}`)},
		task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	res, err := store.Submit(ctx, admin, sub, task.Carrier{"traceparent": "00-" + original + "-00f067aa0ba902b7-01"})
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `UPDATE tasks SET status = 'FAILED', completed_at = now() WHERE id = $1`, res.Task.ID)
	require.NoError(t, err)

	rec := tracetest.NewSpanRecorder()
	rctx, span := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)).Tracer("test").Start(ctx, "POST /v1/tasks/{id}/retry")
	carrier := task.Carrier{"traceparent": "00-" + span.SpanContext().TraceID().String() + "-" + span.SpanContext().SpanID().String() + "-01"}
	retried, err := store.Retry(rctx, admin, res.Task.ID, carrier)
	require.NoError(t, err)
	span.End()
	require.Contains(t, retried.Traceparent, span.SpanContext().TraceID().String(), "the task takes the request's trace")

	ended := rec.Ended()
	require.Len(t, ended, 1)
	var linked []string
	for _, l := range ended[0].Links() {
		linked = append(linked, l.SpanContext.TraceID().String())
	}
	require.Equal(t, []string{original}, linked, "the retry's span links to the trace the task had")
}

// A bulk retry is the single retry applied to many tasks: each task takes
// the request's trace, and the request's span links to every trace the
// retried tasks had (once each, however many tasks shared one), where
// their failed attempts are.
func TestBulkRetryLinksToTheTasksPreviousTraces(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	store := postgres.NewAPIStore(db.Pool, nil)
	_, admin := db.Admin(t)
	previous := []string{"4bf92f3577b34da6a3ce929d0e0e4736", "5bf92f3577b34da6a3ce929d0e0e4737"}
	// Two tasks in the first trace (one batch), one in the second.
	for i, tr := range []string{previous[0], previous[0], previous[1]} {
		sub, err := task.NewSubmission(task.SubmitInput{Type: "retry.traced", Payload: json.RawMessage(fmt.Sprintf(`{"i":%d}`, i))},
			task.Defaults{MaxAttempts: 3}, "")
		require.NoError(t, err)
		_, err = store.Submit(ctx, admin, sub, task.Carrier{"traceparent": "00-" + tr + "-00f067aa0ba902b7-01"})
		require.NoError(t, err)
	}
	_, err := db.Pool.Exec(ctx, `UPDATE tasks SET status = 'FAILED', completed_at = now()`)
	require.NoError(t, err)

	rec := tracetest.NewSpanRecorder()
	rctx, span := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)).Tracer("test").Start(ctx, "POST /v1/tasks/retry")
	carrier := task.Carrier{"traceparent": "00-" + span.SpanContext().TraceID().String() + "-" + span.SpanContext().SpanID().String() + "-01"}
	res, err := store.Bulk(rctx, admin, task.Bulk{Action: task.ActionRetry, Limit: task.MaxBulkLimit}, carrier)
	require.NoError(t, err)
	require.Equal(t, 3, res.Changed)
	span.End()
	var traces []string
	rows, err := db.Pool.Query(ctx, `SELECT DISTINCT split_part(traceparent, '-', 2) FROM tasks`)
	require.NoError(t, err)
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		traces = append(traces, s)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{span.SpanContext().TraceID().String()}, traces, "every task takes the request's trace")

	ended := rec.Ended()
	require.Len(t, ended, 1)
	var linked []string
	for _, l := range ended[0].Links() {
		linked = append(linked, l.SpanContext.TraceID().String())
	}
	require.ElementsMatch(t, previous, linked, "the retry's span links to each trace the tasks had, once")
}
