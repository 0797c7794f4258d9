package main

import (
	"context"
	"fmt"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
)

// statusOf reads a task's status and whether a cancel is pending, as the
// database has them.
func (b *testBundle) statusOf(t *testing.T, id string) (string, bool) {
	t.Helper()
	var status string
	var cancelPending bool
	require.NoError(t, b.db.Pool.QueryRow(context.Background(),
		`SELECT status, cancel_requested_at IS NOT NULL FROM tasks WHERE id = $1`, id).Scan(&status, &cancelPending))
	return status, cancelPending
}

// rowCount counts the rows of a table that a condition on task_id selects.
func (b *testBundle) rowCount(t *testing.T, table, cond string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+table+" WHERE "+cond, args...).Scan(&n))
	return n
}

// A bulk cancel counts first (a dry run changes nothing), refuses a
// confirmation that no longer covers what the filter matches, works
// through the matches limit by limit, and applies what the single cancel
// applies: PENDING tasks end CANCELLED, running ones are asked to stop
// (once), each with an event naming who asked.
func TestBulkCancelCountsConfirmsAndCancels(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	writer, writerP := b.db.Key(t, "test", auth.Writer)
	as := []string{"Authorization", "Bearer " + writer}
	bulk := func(path, body string) response { return b.post(t, path, body, as...) }

	var ids []string
	for i := range 5 {
		ids = append(ids, b.submitTask(t, fmt.Sprintf(`{"type":"bk.a","payload":{"n":%d}}`, i)))
	}
	other := b.submitTask(t, `{"type":"bk.b"}`)
	running := ids[2]
	b.exec(t, `UPDATE tasks SET status = 'IN_PROGRESS', worker_id = 'w1', attempt = 1,
		lease_expires_at = now() + interval '30 seconds', version = version + 1 WHERE id = $1`, running)
	before := b.counts(t)

	dry := bulk("/v1/tasks/cancel", `{"filter":{"type":"bk.a"},"dry_run":true}`)
	require.Equal(t, http.StatusOK, dry.status, string(dry.body))
	require.Equal(t, map[string]any{"matched": float64(5)}, dry.json(t), "a dry run answers the count alone")
	require.Equal(t, before, b.counts(t), "a dry run changes nothing")

	// A task more matches now: the confirmation of 5 covers it not.
	ids = append(ids, b.submitTask(t, `{"type":"bk.a","payload":{"n":5}}`))
	before = b.counts(t)
	refused := bulk("/v1/tasks/cancel", `{"filter":{"type":"bk.a"},"expected":5}`)
	require.Equal(t, http.StatusConflict, refused.status, string(refused.body))
	require.Equal(t, "application/problem+json", refused.header.Get("Content-Type"))
	require.EqualValues(t, 6, refused.json(t)["matched"], "the problem says what the filter matches now")
	require.Equal(t, before, b.counts(t), "a refused action changes nothing")

	// Confirmed at 6, four at a time: the oldest four first.
	first := bulk("/v1/tasks/cancel", `{"filter":{"type":"bk.a"},"expected":6,"limit":4}`)
	require.Equal(t, http.StatusOK, first.status, string(first.body))
	require.Equal(t, map[string]any{"matched": float64(6), "cancelled": float64(4), "skipped": float64(0), "more": true}, first.json(t))
	for _, id := range ids[:4] {
		status, cancelPending := b.statusOf(t, id)
		if id == running {
			require.Equal(t, "IN_PROGRESS", status, "a running task is asked to stop")
			require.True(t, cancelPending)
			continue
		}
		require.Equal(t, "CANCELLED", status)
	}
	for _, id := range ids[4:] {
		status, _ := b.statusOf(t, id)
		require.Equal(t, "PENDING", status, "beyond the limit")
	}
	rest := bulk("/v1/tasks/cancel", `{"filter":{"type":"bk.a"},"expected":2}`)
	require.Equal(t, http.StatusOK, rest.status, string(rest.body))
	require.Equal(t, map[string]any{"matched": float64(2), "cancelled": float64(2), "skipped": float64(0), "more": false}, rest.json(t))

	// Nothing is left to cancel: the running task was asked already.
	again := bulk("/v1/tasks/cancel", `{"filter":{"type":"bk.a"}}`)
	require.Equal(t, map[string]any{"matched": float64(0), "cancelled": float64(0), "skipped": float64(0), "more": false}, again.json(t))
	require.Equal(t, 1, b.rowCount(t, "outbox", "kind = 'task.cancel' AND task_id = $1", running), "one broadcast to the workers")
	status, _ := b.statusOf(t, other)
	require.Equal(t, "PENDING", status, "the filter's type only")

	// Each change has its event, naming the key that asked.
	for _, id := range ids {
		var by string
		require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT principal->>'id' FROM task_events
			WHERE task_id = $1 AND actor = 'API' ORDER BY id DESC LIMIT 1`, id).Scan(&by))
		require.Equal(t, writerP.ID.String(), by, id)
	}
	require.Equal(t, len(ids)-1, b.rowCount(t, "task_events", "state = 'Cancelled' AND actor = 'API'"))
	require.Equal(t, 1, b.rowCount(t, "task_events", "state = 'Cancel requested' AND task_id = $1", running))
}

// A bulk retry puts FAILED and CANCELLED tasks back to PENDING from attempt
// 0, queued again, as the single retry does; the status filter narrows it.
func TestBulkRetry(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cancelled := b.submitTask(t, `{"type":"br.a","payload":{"n":1}}`)
	require.Equal(t, http.StatusOK, b.post(t, "/v1/tasks/"+cancelled+"/cancel", "").status)
	failed := b.submitTask(t, `{"type":"br.a","payload":{"n":2}}`)
	b.exec(t, `UPDATE tasks SET status = 'FAILED', attempt = 3, error = 'boom', completed_at = now(),
		version = version + 1 WHERE id = $1`, failed)
	pending := b.submitTask(t, `{"type":"br.a","payload":{"n":3}}`)

	dry := b.post(t, "/v1/tasks/retry", `{"filter":{"type":"br.a"},"dry_run":true}`)
	require.Equal(t, map[string]any{"matched": float64(2)}, dry.json(t), "FAILED and CANCELLED tasks only")
	onlyFailed := b.post(t, "/v1/tasks/retry", `{"filter":{"type":"br.a","status":"FAILED"},"dry_run":true}`)
	require.Equal(t, map[string]any{"matched": float64(1)}, onlyFailed.json(t))

	runs := b.rowCount(t, "outbox", "kind = 'task.run'")
	done := b.post(t, "/v1/tasks/retry", `{"filter":{"type":"br.a"},"expected":2}`)
	require.Equal(t, http.StatusOK, done.status, string(done.body))
	require.Equal(t, map[string]any{"matched": float64(2), "retried": float64(2), "skipped": float64(0), "more": false}, done.json(t))
	for _, id := range []string{cancelled, failed} {
		got := b.get(t, "/v1/tasks/"+id).json(t)
		require.Equal(t, "PENDING", got["status"])
		require.EqualValues(t, 0, got["attempt"])
		require.Nil(t, got["error"])
	}
	require.Equal(t, runs+2, b.rowCount(t, "outbox", "kind = 'task.run'"), "both are queued again")
	status, _ := b.statusOf(t, pending)
	require.Equal(t, "PENDING", status)
}

// A bulk action counts and changes only the tasks its caller may see:
// another org's, and tasks restricted to an org role the caller lacks,
// are neither counted nor touched.
func TestBulkActionsKeepToWhatTheCallerSees(t *testing.T) {
	t.Parallel()
	b := setup(t)
	outsider, _ := b.db.Key(t, "test", auth.Writer)
	seer, _ := b.db.Key(t, "test", auth.Writer, "seers")
	otherOrg, _ := b.db.Key(t, "other", auth.Writer)
	open := b.submitTask(t, `{"type":"bv.a","payload":{"n":1}}`)
	restricted := b.submitTask(t, `{"type":"bv.a","payload":{"n":2},"visibility":["seers"]}`)
	as := func(token string) []string { return []string{"Authorization", "Bearer " + token} }

	require.Equal(t, map[string]any{"matched": float64(0)},
		b.post(t, "/v1/tasks/cancel", `{"filter":{"type":"bv.a"},"dry_run":true}`, as(otherOrg)...).json(t))
	require.Equal(t, map[string]any{"matched": float64(0), "cancelled": float64(0), "skipped": float64(0), "more": false},
		b.post(t, "/v1/tasks/cancel", `{"filter":{"q":"`+restricted+`"}}`, as(outsider)...).json(t))
	require.Equal(t, map[string]any{"matched": float64(1)},
		b.post(t, "/v1/tasks/cancel", `{"filter":{"type":"bv.a"},"dry_run":true}`, as(outsider)...).json(t))
	require.Equal(t, map[string]any{"matched": float64(1), "cancelled": float64(1), "skipped": float64(0), "more": false},
		b.post(t, "/v1/tasks/cancel", `{"filter":{"type":"bv.a"},"expected":1}`, as(outsider)...).json(t))
	status, _ := b.statusOf(t, open)
	require.Equal(t, "CANCELLED", status)
	status, _ = b.statusOf(t, restricted)
	require.Equal(t, "PENDING", status, "outside the caller's visibility")

	require.Equal(t, map[string]any{"matched": float64(1), "cancelled": float64(1), "skipped": float64(0), "more": false},
		b.post(t, "/v1/tasks/cancel", `{"filter":{"type":"bv.a"},"expected":1}`, as(seer)...).json(t))
	status, _ = b.statusOf(t, restricted)
	require.Equal(t, "CANCELLED", status)
}

// Bad bulk requests are refused, and change nothing.
func TestBulkRefusesBadRequests(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.submitTask(t, `{"type":"bx.a"}`)
	tests := []struct {
		name, path, body string
		status           int
		field            string
	}{
		{"retry of PENDING tasks", "/v1/tasks/retry", `{"filter":{"status":"PENDING"}}`, 422, "filter.status"},
		{"cancel of COMPLETED tasks", "/v1/tasks/cancel", `{"filter":{"status":"COMPLETED"}}`, 422, "filter.status"},
		{"unknown status", "/v1/tasks/cancel", `{"filter":{"status":"DONE"}}`, 422, "filter.status"},
		{"bad type", "/v1/tasks/cancel", `{"filter":{"type":"Not A Type"}}`, 422, "filter.type"},
		{"bad time", "/v1/tasks/cancel", `{"filter":{"created_after":"yesterday"}}`, 422, "filter.created_after"},
		{"empty window", "/v1/tasks/cancel", `{"filter":{"created_after":"2026-01-02T00:00:00Z","created_before":"2026-01-01T00:00:00Z"}}`, 422, "filter.created_before"},
		{"bad search", "/v1/tasks/retry", `{"filter":{"q":"no-equals-sign"}}`, 422, "filter.q"},
		{"limit 0", "/v1/tasks/cancel", `{"limit":0}`, 422, "limit"},
		{"limit over 1000", "/v1/tasks/cancel", `{"limit":1001}`, 422, "limit"},
		{"negative expected", "/v1/tasks/cancel", `{"expected":-1}`, 422, "expected"},
		{"unknown filter", "/v1/tasks/cancel", `{"filter":{"stauts":"PENDING"}}`, 400, ""},
		{"not JSON", "/v1/tasks/cancel", `filter`, 400, ""},
	}
	before := b.counts(t)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := b.post(t, tt.path, tt.body)
			require.Equal(t, tt.status, resp.status, string(resp.body))
			require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"))
			if tt.field != "" {
				require.Equal(t, tt.field, resp.json(t)["field"])
			}
			require.Equal(t, before, b.counts(t))
		})
	}
	reader, _ := b.db.Key(t, "test", auth.Reader)
	require.Equal(t, http.StatusForbidden, b.post(t, "/v1/tasks/cancel", `{"dry_run":true}`, "Authorization", "Bearer "+reader).status,
		"even a dry run needs the writer role")
}

// A bulk cancel of children of several parents locks each parent as its
// child settles (the parent may be waiting for it), in the order of the
// children; a worker's batch settling children of the same parents in the
// other order can deadlock with it. PostgreSQL then rolls the bulk action
// back whole, and the store runs it again, as it does a worker's batch:
// the caller gets its answer, not a 500.
func TestBulkCancelRecoversFromADeadlockWithAWorker(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	first := b.submitTask(t, `{"type":"bd.parent","payload":{"n":1}}`)
	second := b.submitTask(t, `{"type":"bd.parent","payload":{"n":2}}`)
	low := b.submitTask(t, `{"type":"bd.child","payload":{"n":1}}`)
	high := b.submitTask(t, `{"type":"bd.child","payload":{"n":2}}`)
	require.Less(t, low, high, "task ids grow with time")
	// The lower child (settled first) belongs to the first parent.
	b.exec(t, `UPDATE tasks SET parent_id = $2, child_key = 'a' WHERE id = $1`, low, first)
	b.exec(t, `UPDATE tasks SET parent_id = $2, child_key = 'b' WHERE id = $1`, high, second)

	// What a worker's batch settling children of both parents, in the
	// other order, holds midway: the second parent.
	worker, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = worker.Rollback(ctx) }()
	// PostgreSQL looks for a deadlock in the session whose wait outlasts
	// its deadlock_timeout first, and rolls that one back: this session
	// waits long, so the API's transaction is always the one.
	_, err = worker.Exec(ctx, `SET LOCAL deadlock_timeout = '30s'`)
	require.NoError(t, err)
	_, err = worker.Exec(ctx, `SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE`, second)
	require.NoError(t, err)

	answer := make(chan response, 1)
	go func() { answer <- b.post(t, "/v1/tasks/cancel", `{"filter":{"type":"bd.child"},"expected":2}`) }()
	// The bulk cancel has settled both children and locked the first
	// parent; it waits for the second.
	b.db.WaitForLockWait(t)
	// The worker's batch goes on to the first parent: a deadlock, which
	// PostgreSQL breaks by rolling back the bulk cancel (it waited first).
	_, err = worker.Exec(ctx, `SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE`, first)
	require.NoError(t, err)
	require.NoError(t, worker.Commit(ctx))

	resp := <-answer
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	require.Equal(t, map[string]any{"matched": float64(2), "cancelled": float64(2), "skipped": float64(0), "more": false}, resp.json(t))
	for _, id := range []string{low, high} {
		status, _ := b.statusOf(t, id)
		require.Equal(t, "CANCELLED", status)
	}
}

// A running task's lease renewals and progress reports move its version
// and nothing a cancel looks at. A bulk cancel that meets one between its
// pick and its change still asks the task to stop, as the single cancel
// does: skipped, it would go on running while the answer says no task is
// left ("more": false).
func TestBulkCancelAsksARunningTaskToStopThroughItsRenewal(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	running := b.submitTask(t, `{"type":"bh.a","payload":{"n":1}}`)
	b.exec(t, `UPDATE tasks SET status = 'IN_PROGRESS', worker_id = 'w1', attempt = 1,
		lease_expires_at = now() + interval '30 seconds', version = version + 1 WHERE id = $1`, running)

	// The worker renews the lease, its transaction still open while the
	// bulk cancel picks the task at the version before.
	worker, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = worker.Rollback(ctx) }()
	_, err = worker.Exec(ctx, `UPDATE tasks SET lease_expires_at = now() + interval '30 seconds',
		version = version + 1 WHERE id = $1`, running)
	require.NoError(t, err)

	answer := make(chan response, 1)
	go func() { answer <- b.post(t, "/v1/tasks/cancel", `{"filter":{"type":"bh.a"},"expected":1}`) }()
	b.db.WaitForLockWait(t)
	require.NoError(t, worker.Commit(ctx))

	resp := <-answer
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	require.Equal(t, map[string]any{"matched": float64(1), "cancelled": float64(1), "skipped": float64(0), "more": false}, resp.json(t))
	status, cancelPending := b.statusOf(t, running)
	require.Equal(t, "IN_PROGRESS", status)
	require.True(t, cancelPending, "the running task is asked to stop")
	require.Equal(t, 1, b.rowCount(t, "outbox", "kind = 'task.cancel' AND task_id = $1", running), "one broadcast to the workers")
}
