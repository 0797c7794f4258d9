package postgres_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/job"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// statementSQL is the text of the named statement.
func statementSQL(t *testing.T, name string) string {
	t.Helper()
	for _, st := range postgres.Statements() {
		if st.Name == name {
			return st.SQL
		}
	}
	t.Fatalf("no statement %s", name)
	return ""
}

// explain returns the plan PostgreSQL picks for sql with args.
func (b *storeBundle) explain(t *testing.T, sql string, args ...any) string {
	t.Helper()
	return explainOn(t, b.db.Pool, sql, args...)
}

// explainUnder returns the plan PostgreSQL picks for sql with args in a
// transaction that the named statement set up first.
func (b *storeBundle) explainUnder(t *testing.T, settings, sql string, args ...any) string {
	t.Helper()
	ctx := context.Background()
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, statementSQL(t, settings))
	require.NoError(t, err)
	return explainOn(t, tx, sql, args...)
}

func explainOn(t *testing.T, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, sql string, args ...any) string {
	t.Helper()
	rows, err := q.Query(context.Background(), "EXPLAIN "+sql, args...)
	require.NoError(t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return strings.Join(lines, "\n")
}

// reap does what the maintenance leader does with expired leases.
func (b *storeBundle) reap(t *testing.T) map[task.Transition]int {
	t.Helper()
	ctx := context.Background()
	expired, err := b.maint.ExpiredLeases(ctx, 100)
	require.NoError(t, err)
	changes := make([]task.Change, len(expired))
	for i, e := range expired {
		tr := task.OnLeaseExpired(e.CancelPending, e.Attempt, e.MaxAttempts)
		changes[i] = task.Change{TaskID: e.ID, Version: e.Version, Transition: tr, Error: "lease expired"}
	}
	got := map[task.Transition]int{}
	if len(changes) == 0 {
		return got
	}
	out, errs, err := b.maint.Apply(ctx, changes)
	require.NoError(t, err)
	for i, o := range out {
		require.NoError(t, errs[i])
		if !o.Fenced {
			got[changes[i].Transition]++
		}
	}
	return got
}

func TestExpiredLeasesEndEachAttemptRightly(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	retry, exhausted, cancelled := b.pending(t, 3), b.pending(t, 1), b.pending(t, 3)
	for _, id := range []uuid.UUID{retry, exhausted, cancelled} {
		b.claim(t, id, "dead")
	}
	_, _, err := b.api.Cancel(ctx, b.admin, cancelled, nil)
	require.NoError(t, err)
	b.exec(t, `DELETE FROM outbox`)
	b.exec(t, `UPDATE tasks SET lease_expires_at = now() - interval '1 second'`)

	require.Equal(t, map[task.Transition]int{task.ExpireRequeue: 1, task.ExpireFail: 1, task.ExpireCancel: 1}, b.reap(t))
	status := func(id uuid.UUID) string { return b.text(t, `SELECT status FROM tasks WHERE id = $1`, id) }
	require.Equal(t, "PENDING", status(retry))
	require.Equal(t, "FAILED", status(exhausted))
	require.Equal(t, "CANCELLED", status(cancelled))
	require.Equal(t, "lease expired", b.text(t, `SELECT error FROM tasks WHERE id = $1`, exhausted))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM outbox WHERE task_id = $1 AND kind = 'task.run'`, retry), "re-queued")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM outbox`), "only the re-queued task")
	require.Empty(t, b.reap(t), "idempotent")
}

// Republication is keyed on the broker's confirmation, not on when the task
// was submitted: a task whose message was confirmed a moment ago is waiting
// in its queue, whatever its age; a task with a message still in the outbox
// is waiting for the relay.
func TestStalePendingIsKeyedOnTheConfirmation(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	lost, justPublished, queued, fresh := b.pending(t, 3), b.pending(t, 3), b.pending(t, 3), b.pending(t, 3)
	b.exec(t, `UPDATE tasks SET next_run_at = now() - interval '1 hour', created_at = now() - interval '1 hour' WHERE id <> $1`, fresh)
	b.exec(t, `UPDATE tasks SET published_at = now() - interval '30 minutes' WHERE id = $1`, lost)
	b.exec(t, `UPDATE tasks SET published_at = now() WHERE id = $1`, justPublished)
	b.exec(t, `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version) VALUES ('task.run', `+testdb.OrgSQL+`, $1, 'demo.noop', 0, 1)`, queued)

	stale, err := b.maint.StalePending(ctx, 10*time.Minute, 100, nil)
	require.NoError(t, err)
	require.Len(t, stale, 1)
	require.Equal(t, lost, stale[0].ID)
	skipped, err := b.maint.StalePending(ctx, 10*time.Minute, 100, []string{"demo.noop"})
	require.NoError(t, err)
	require.Empty(t, skipped, "the tasks of a type whose queue the leader found busy are left out")

	out, errs, err := b.maint.Apply(ctx, []task.Change{{TaskID: lost, Version: stale[0].Version, Transition: task.Republish}})
	require.NoError(t, err)
	require.NoError(t, errs[0])
	require.False(t, out[0].Fenced)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM outbox WHERE task_id = $1`, lost))
	stale, err = b.maint.StalePending(ctx, 10*time.Minute, 100, nil)
	require.NoError(t, err)
	require.Empty(t, stale, "its message waits in the outbox now")
}

// However large the outbox (an outage's backlog), the stale-task query
// stays one anti-join rather than a lookup per task.
func TestStalePendingIsAnAntiJoinOverALargeOutbox(t *testing.T) {
	b := setupStores(t)
	b.exec(t, `INSERT INTO tasks (id, org_id, type, next_run_at, created_at)
		SELECT gen_random_uuid(), `+testdb.OrgSQL+`, 'demo.noop', now() - interval '1 hour', now() - interval '1 hour' FROM generate_series(1, 2000)`)
	b.exec(t, `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version)
		SELECT 'task.run', `+testdb.OrgSQL+`, gen_random_uuid(), 'demo.noop', 0, 1 FROM generate_series(1, 300000)`)
	b.exec(t, `ANALYZE tasks`)
	b.exec(t, `ANALYZE outbox`)
	plan := b.explain(t, statementSQL(t, "tasks.stale_pending"), int64(600000), 1000, []string{})
	require.Contains(t, plan, "Anti Join", plan)
	require.NotContains(t, plan, "SubPlan", plan)
}

// The relay takes its batches along the outbox_available index, in its
// order, without sorting the backlog.
func TestRelayClaimUsesTheOutboxIndex(t *testing.T) {
	b := setupStores(t)
	b.exec(t, `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version, available_at)
		SELECT 'task.run', `+testdb.OrgSQL+`, gen_random_uuid(), 'demo.noop', 0, 1, now() - (g % 1000) * interval '1 second'
		FROM generate_series(1, 200000) g`)
	b.exec(t, `ANALYZE outbox`)
	plan := b.explain(t, statementSQL(t, "outbox.claim"), 500)
	require.Contains(t, plan, "Index Scan using outbox_available", plan)
	require.NotContains(t, plan, "Sort", plan)
}

// The scheduler counts a type's queued tasks, as a whole and per
// priority, through the index of queued tasks alone. Statistics taken while the whole backlog was queued made a
// scan of the table look cheap for a LIMIT (matching rows "come early");
// burnt down in order, the queued rows come last, behind every finished one.
func TestTypeLoadCountsQueuedTasksThroughTheirIndex(t *testing.T) {
	b := setupStores(t)
	b.exec(t, `INSERT INTO task_types (name) VALUES ('demo.noop')`)
	b.exec(t, `INSERT INTO tasks (id, org_id, type, next_run_at)
		SELECT gen_random_uuid(), `+testdb.OrgSQL+`, 'demo.noop', now() - interval '1 hour' FROM generate_series(1, 20000)`)
	b.exec(t, `ANALYZE tasks`)
	b.exec(t, `UPDATE tasks SET status = 'COMPLETED', completed_at = now() WHERE id IN (SELECT id FROM tasks LIMIT 19000)`)
	for _, plan := range []string{
		b.explain(t, statementSQL(t, "scheduler.type_load"), 0, int64(60000), 64, []string{}),
		b.explain(t, statementSQL(t, "scheduler.queued_by_priority"), []string{"demo.noop"}, []int{641}),
	} {
		require.Contains(t, plan, "using tasks_ready on tasks", plan)
		require.NotContains(t, plan, "Seq Scan on tasks", plan)
	}
}

// Nor does a fresh backlog, which no statistics have seen yet: the planner
// expects one matching row, and would count by walking every open task of
// the type, fetching each from the table, then sorting them.
func TestTypeLoadCountsAFreshBacklogThroughItsIndex(t *testing.T) {
	b := setupStores(t)
	b.exec(t, `INSERT INTO task_types (name) VALUES ('demo.noop')`)
	b.exec(t, `ANALYZE tasks`)
	b.exec(t, `INSERT INTO tasks (id, org_id, type, next_run_at)
		SELECT gen_random_uuid(), `+testdb.OrgSQL+`, 'demo.noop', now() - interval '1 hour' FROM generate_series(1, 20000)`)
	for _, plan := range []string{
		b.explainUnder(t, "scheduler.settings", statementSQL(t, "scheduler.type_load"), 0, int64(60000), 64, []string{}),
		b.explainUnder(t, "scheduler.settings", statementSQL(t, "scheduler.queued_by_priority"), []string{"demo.noop"}, []int{641}),
	} {
		require.Contains(t, plan, "using tasks_ready on tasks", plan)
		require.NotContains(t, plan, "Sort", plan)
	}
}

// The reaper reads running tasks entry by entry, so that the entries of
// tasks finished since the last vacuum are marked dead once and skipped
// by later passes; a bitmap scan would visit every one of those rows on
// every pass.
func TestReaperReadsRunningTasksEntryByEntry(t *testing.T) {
	b := setupStores(t)
	b.exec(t, `INSERT INTO tasks (id, org_id, type, next_run_at)
		SELECT gen_random_uuid(), `+testdb.OrgSQL+`, 'demo.noop', now() - interval '1 hour' FROM generate_series(1, 20000)`)
	b.exec(t, `UPDATE tasks SET status = 'IN_PROGRESS', attempt = 1, lease_expires_at = now() + interval '1 minute',
		heartbeat_timeout_ms = 60000, heartbeat_at = now() WHERE id IN (SELECT id FROM tasks LIMIT 400)`)
	b.exec(t, `ANALYZE tasks`)
	b.exec(t, `UPDATE tasks SET status = 'IN_PROGRESS', attempt = 1, lease_expires_at = now() + interval '1 minute',
		heartbeat_timeout_ms = 60000, heartbeat_at = now() WHERE status = 'PENDING'`)
	b.exec(t, `UPDATE tasks SET status = 'COMPLETED', completed_at = now() WHERE id IN (SELECT id FROM tasks LIMIT 19600)`)
	for name, args := range map[string][]any{"tasks.expired_leases": {1000}, "tasks.heartbeat_expired": {1000, int64(30000)}} {
		plan := b.explainUnder(t, "maintenance.index_scans", statementSQL(t, name), args...)
		require.Contains(t, plan, "Index Scan using tasks_running on tasks", name+"\n"+plan)
		require.NotContains(t, plan, "Bitmap", name+"\n"+plan)
	}
}

// A batch of retention deletes its tasks by their key: joined to the
// expired tasks instead, each batch read the whole backlog again, and a
// large one (retention switched on, a burst finished) took hours to work
// off, a batch at a time. Nor does a batch read every idempotency key.
func TestRetentionDeletesABatchByKey(t *testing.T) {
	b := setupStores(t)
	b.exec(t, `INSERT INTO tasks (id, org_id, type, status, completed_at)
		SELECT gen_random_uuid(), `+testdb.OrgSQL+`, 'demo.noop', 'COMPLETED', now() - interval '10 days'
		FROM generate_series(1, 20000)`)
	b.exec(t, `INSERT INTO task_idempotency_keys (org_id, type, key, task_id, created_at)
		SELECT org_id, type, id::text, id, now() - interval '10 days' FROM tasks`)
	b.exec(t, `ANALYZE tasks`)
	b.exec(t, `ANALYZE task_idempotency_keys`)
	retention := int64(7 * 24 * time.Hour / time.Millisecond)
	pick := b.explain(t, statementSQL(t, "tasks.delete_expired.pick"), retention, 1000)
	require.NotContains(t, pick, "Seq Scan on task_idempotency_keys", pick)
	rows, err := b.db.Pool.Query(context.Background(), `SELECT id FROM tasks LIMIT 1000`)
	require.NoError(t, err)
	batch, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	plan := b.explain(t, statementSQL(t, "tasks.delete_expired"), retention, batch)
	require.Contains(t, plan, "Index Cond: (id = ANY", plan)
	require.NotContains(t, plan, "Semi Join", plan)
	require.NotContains(t, plan, "Seq Scan on task_idempotency_keys", plan)
}

func TestRetentionDeletesOldTerminalTasksWithTheirHistory(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	old, recent, running := b.pending(t, 3), b.pending(t, 3), b.pending(t, 3)
	for _, id := range []uuid.UUID{old, recent} {
		l := b.claim(t, id, "w")
		b.apply(t, task.Change{TaskID: id, Version: l.Version, Transition: task.Complete, Result: json.RawMessage(`{"ok": true}`)})
	}
	b.claim(t, running, "w")
	b.exec(t, `UPDATE tasks SET completed_at = now() - interval '8 days' WHERE id = $1`, old)

	n, err := b.maint.DeleteExpired(ctx, 7*24*time.Hour, 100)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Zero(t, b.count(t, `SELECT count(*) FROM task_events WHERE task_id = $1`, old))
	require.Zero(t, b.count(t, `SELECT count(*) FROM task_results WHERE task_id = $1`, old))
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM tasks`))
}

// A task's input hash deduplicates submissions for as long as the task is
// kept, and retention frees it: the same input then makes a new task.
func TestRetentionFreesTheInputHash(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	submit := func() task.Submitted {
		t.Helper()
		sub, err := task.NewSubmission(task.SubmitInput{Type: "demo.noop", Payload: json.RawMessage(`{"n": 1}`)},
			task.Defaults{MaxAttempts: 3}, "")
		require.NoError(t, err)
		out, err := b.api.Submit(ctx, b.admin, sub, nil)
		require.NoError(t, err)
		return out
	}
	first := submit()
	require.True(t, first.Created)
	again := submit()
	require.False(t, again.Created, "the same input while its task is kept")
	require.Equal(t, first.Task.ID, again.Task.ID)

	l := b.claim(t, first.Task.ID, "w")
	b.apply(t, task.Change{TaskID: first.Task.ID, Version: l.Version, Transition: task.Complete, Result: json.RawMessage(`{}`)})
	b.exec(t, `UPDATE tasks SET completed_at = now() - interval '8 days' WHERE id = $1`, first.Task.ID)
	n, err := b.maint.DeleteExpired(ctx, 7*24*time.Hour, 100)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Zero(t, b.count(t, `SELECT count(*) FROM task_input_hashes`))

	after := submit()
	require.True(t, after.Created, "the same input after retention")
	require.NotEqual(t, first.Task.ID, after.Task.ID)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM task_input_hashes WHERE task_id = $1`, after.Task.ID))
}

// An Idempotency-Key is kept for RETENTION after it was bound, though the
// task it names (found by its input) finished longer ago: the same request
// sent again meanwhile gets that task, not a second one.
func TestRetentionKeepsAKeyBoundWithinIt(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	submit := func(key string) task.Submitted {
		t.Helper()
		sub, err := task.NewSubmission(task.SubmitInput{Type: "demo.noop", Payload: json.RawMessage(`{"n": 1}`),
			IdempotencyKey: key}, task.Defaults{MaxAttempts: 3}, "")
		require.NoError(t, err)
		out, err := b.api.Submit(ctx, b.admin, sub, nil)
		require.NoError(t, err)
		return out
	}
	first := submit("")
	l := b.claim(t, first.Task.ID, "w")
	b.apply(t, task.Change{TaskID: first.Task.ID, Version: l.Version, Transition: task.Complete, Result: json.RawMessage(`{}`)})
	// Finished almost RETENTION ago when the keyed request finds it.
	b.exec(t, `UPDATE tasks SET completed_at = now() - interval '6 days 23 hours' WHERE id = $1`, first.Task.ID)
	keyed := submit("order-7")
	require.False(t, keyed.Created)
	require.Equal(t, first.Task.ID, keyed.Task.ID)

	// Two hours later the task is past retention; the key is not.
	b.exec(t, `UPDATE tasks SET completed_at = completed_at - interval '2 hours' WHERE id = $1`, first.Task.ID)
	b.exec(t, `UPDATE task_idempotency_keys SET created_at = created_at - interval '2 hours'`)
	n, err := b.maint.DeleteExpired(ctx, 7*24*time.Hour, 100)
	require.NoError(t, err)
	require.Zero(t, n)
	again := submit("order-7")
	require.False(t, again.Created, "the keyed request sent again")
	require.Equal(t, first.Task.ID, again.Task.ID)

	// Once the key is past retention too, both go.
	b.exec(t, `UPDATE task_idempotency_keys SET created_at = created_at - interval '7 days'`)
	n, err = b.maint.DeleteExpired(ctx, 7*24*time.Hour, 100)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Zero(t, b.count(t, `SELECT count(*) FROM task_idempotency_keys`))
}

// Every task is listed, however it was written (here one plain INSERT of
// two, as a workflow's node is written), and retention unlists it.
func TestEveryTaskIsListedUntilRetention(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	var ids []uuid.UUID
	rows, err := b.db.Pool.Query(ctx, `INSERT INTO tasks (id, org_id, type)
		SELECT conveyor_uuidv7(), `+testdb.OrgSQL+`, t FROM unnest('{demo.noop,demo.sleep}'::text[]) t RETURNING id`)
	require.NoError(t, err)
	for rows.Next() {
		var id uuid.UUID
		require.NoError(t, rows.Scan(&id))
		ids = append(ids, id)
	}
	require.NoError(t, rows.Err())
	listed := func(f task.Filter) []uuid.UUID {
		t.Helper()
		got, err := b.api.List(ctx, b.admin, task.ListFilter{Filter: f, Limit: 10})
		require.NoError(t, err)
		out := []uuid.UUID{}
		for _, g := range got {
			out = append(out, g.ID)
		}
		return out
	}
	require.ElementsMatch(t, ids, listed(task.Filter{}))
	require.Len(t, listed(task.Filter{Type: "demo.sleep"}), 1)

	b.exec(t, `UPDATE tasks SET status = 'CANCELLED', completed_at = now() - interval '8 days'`)
	n, err := b.maint.DeleteExpired(ctx, 7*24*time.Hour, 100)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.Empty(t, listed(task.Filter{}))
	require.Zero(t, b.count(t, `SELECT count(*) FROM task_listing`))
}

func TestLeadershipIsHeldByOneAtATime(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	elect := func(id string) bool {
		ok, err := b.maint.Elect(ctx, "maintenance", id, time.Minute)
		require.NoError(t, err)
		return ok
	}
	require.True(t, elect("a"))
	require.False(t, elect("b"))
	require.True(t, elect("a"), "the leader extends its term")

	b.exec(t, `UPDATE leaders SET expires_at = now() - interval '1 second'`)
	require.True(t, elect("b"), "an expired leadership is taken")
	require.False(t, elect("a"))

	require.NoError(t, b.maint.Resign(ctx, "maintenance", "b"))
	require.True(t, elect("a"), "a resigned leadership is free at once")
}

// Parked messages are released for types a live worker consumes, kept for
// the others, and dropped once their task is no longer PENDING.
func TestReleaseParked(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	served, unserved, gone := b.pending(t, 3), b.pending(t, 3), b.pending(t, 3)
	b.exec(t, `UPDATE tasks SET type = 'other.type' WHERE id = $1`, unserved)
	b.exec(t, `INSERT INTO workers (id, hostname, pid, concurrency, types) VALUES ('w', 'h', 1, 1, '{demo.noop}')`)
	for _, id := range []uuid.UUID{served, unserved, gone} {
		b.exec(t, `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version, available_at)
			SELECT 'task.run', `+testdb.OrgSQL+`, id, type, 0, 1, 'infinity' FROM tasks WHERE id = $1`, id)
	}
	_, _, err := b.api.Cancel(ctx, b.admin, gone, nil)
	require.NoError(t, err)

	types, err := b.maint.ParkedTypes(ctx, time.Minute)
	require.NoError(t, err)
	require.Equal(t, []string{"demo.noop"}, types)
	n, err := b.maint.ReleaseParked(ctx, types)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM outbox WHERE task_id = $1 AND available_at <= now()`, served))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM outbox WHERE task_id = $1 AND available_at = 'infinity'`, unserved))
	require.Zero(t, b.count(t, `SELECT count(*) FROM outbox WHERE task_id = $1`, gone))
}

// A task retried while retention deletes it stays: the deletion re-checks
// the row the retry committed, which is PENDING again and no longer expired.
func TestRetentionKeepsATaskRetriedMeanwhile(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	id := b.pending(t, 1)
	l := b.claim(t, id, "w")
	b.apply(t, task.Change{TaskID: id, Version: l.Version, Transition: task.Fail, Error: "boom"})
	b.exec(t, `UPDATE tasks SET completed_at = now() - interval '8 days' WHERE id = $1`, id)

	// The retry holds the row when retention comes to it.
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `UPDATE tasks SET status = 'PENDING', completed_at = NULL, attempt = 0,
		version = version + 1 WHERE id = $1`, id)
	require.NoError(t, err)
	type deleted struct {
		n   int
		err error
	}
	done := make(chan deleted, 1)
	go func() {
		n, err := b.maint.DeleteExpired(ctx, 7*24*time.Hour, 100)
		done <- deleted{n, err}
	}()
	require.Eventually(t, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND query LIKE '%tasks.delete_expired%'`) == 1
	}, 10*time.Second, 10*time.Millisecond, "retention waits for the retry's lock")
	require.NoError(t, tx.Commit(ctx))

	got := <-done
	require.NoError(t, got.err)
	require.Zero(t, got.n, "the retried task is not expired any more")
	require.Equal(t, "PENDING", b.text(t, `SELECT status FROM tasks WHERE id = $1`, id))
}

// completeRun runs the diamond with params to its end, every node
// completing.
func (h *wfHarness) completeRun(params string) uuid.UUID {
	h.t.Helper()
	run, err := h.store.StartRun(context.Background(), h.p, "diamond", job.RunRequest{Params: json.RawMessage(params)})
	require.NoError(h.t, err)
	for _, node := range []string{"a", "b", "c", "d"} {
		if tk := h.nodeTasks(run.ID)[node]; tk.ID != uuid.Nil && tk.Status == task.StatusPending {
			h.settle(tk.ID, task.Complete, `{"`+node+`": 1}`)
		}
	}
	require.Equal(h.t, job.RunCompleted, h.run(run.ID).Status)
	return run.ID
}

// age backdates runs' ends, and every dataset version, past retention,
// and the ends of those runs' tasks, which retention then deletes.
func (h *wfHarness) age(runs ...uuid.UUID) {
	h.t.Helper()
	h.exec(`UPDATE workflow_runs SET finished_at = now() - interval '8 days' WHERE id = ANY ($1)`, runs)
	h.exec(`UPDATE dataset_versions SET created_at = now() - interval '8 days'`)
	h.exec(`UPDATE tasks SET completed_at = now() - interval '8 days' WHERE run_id = ANY ($1) AND completed_at IS NOT NULL`, runs)
	_, err := postgres.NewMaintenanceStore(h.db.Pool, nil).DeleteExpired(context.Background(), 7*24*time.Hour, 1000)
	require.NoError(h.t, err)
}

func (h *wfHarness) deleteExpiredRuns(limit int) int {
	h.t.Helper()
	n, err := postgres.NewMaintenanceStore(h.db.Pool, nil).DeleteExpiredRuns(context.Background(), 7*24*time.Hour, limit)
	require.NoError(h.t, err)
	return n
}

func (h *wfHarness) deleteExpiredVersions() int {
	h.t.Helper()
	n, err := postgres.NewMaintenanceStore(h.db.Pool, nil).DeleteExpiredVersions(context.Background(), 7*24*time.Hour, 100)
	require.NoError(h.t, err)
	return n
}

func (h *wfHarness) count(sql string, args ...any) int {
	h.t.Helper()
	var n int
	require.NoError(h.t, h.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// Retention deletes a run that ended longer ago than RETENTION, with its
// nodes, a batch at a time; a run still running, one that ended within
// RETENTION and one with a task still in flight stay. Before, runs and
// their nodes were never deleted.
func TestRetentionDeletesRunsEndedLongAgo(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	old1, old2 := h.completeRun(`{"day": 1}`), h.completeRun(`{"day": 2}`)
	recent := h.completeRun(`{"day": 3}`)
	running, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: json.RawMessage(`{"day": 4}`)})
	require.NoError(t, err)
	// b fails while c is still pending: the run fails with c in flight.
	stopped, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: json.RawMessage(`{"day": 5}`)})
	require.NoError(t, err)
	h.settle(h.nodeTasks(stopped.ID)["a"].ID, task.Complete, `{}`)
	h.settle(h.nodeTasks(stopped.ID)["b"].ID, task.Fail, "")
	require.Equal(t, job.RunFailed, h.run(stopped.ID).Status)
	c := h.nodeTasks(stopped.ID)["c"]
	require.Equal(t, task.StatusPending, c.Status)
	h.age(old1, old2, stopped.ID)

	require.Equal(t, 1, h.deleteExpiredRuns(1), "a batch is bounded")
	require.Equal(t, 1, h.deleteExpiredRuns(1))
	require.Equal(t, 0, h.deleteExpiredRuns(1))
	for _, id := range []uuid.UUID{old1, old2} {
		require.Zero(t, h.count(`SELECT count(*) FROM workflow_runs WHERE id = $1`, id))
		require.Zero(t, h.count(`SELECT count(*) FROM run_nodes WHERE run_id = $1`, id))
	}
	for _, id := range []uuid.UUID{recent, running.ID, stopped.ID} {
		require.Equal(t, 1, h.count(`SELECT count(*) FROM workflow_runs WHERE id = $1`, id))
		require.Equal(t, 4, h.count(`SELECT count(*) FROM run_nodes WHERE run_id = $1`, id))
	}

	// Once its last task ends, the stopped run goes too.
	h.settle(c.ID, task.Fail, "")
	require.Equal(t, 1, h.deleteExpiredRuns(100))
	require.Zero(t, h.count(`SELECT count(*) FROM workflow_runs WHERE id = $1`, stopped.ID))
}

func (h *wfHarness) exec(sql string, args ...any) {
	h.t.Helper()
	_, err := h.db.Pool.Exec(context.Background(), sql, args...)
	require.NoError(h.t, err)
}

// A dataset's older versions go once they are past RETENTION and nothing
// reads them; its newest stays whatever its age, and so does a version
// whose task a remaining run's node memoized.
func TestRetentionDeletesOldDatasetVersionsNothingReads(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	first := h.completeRun(`{"day": 1}`)
	// The same params: every node is memoized from the first run.
	memo := h.completeRun(`{"day": 1}`)
	require.Equal(t, "MEMOIZED", nodeStatus(h.run(memo))["a"])
	second := h.completeRun(`{"day": 2}`)
	third := h.completeRun(`{"day": 3}`)
	versions := func() []int64 {
		rows, err := h.db.Pool.Query(context.Background(), `SELECT id FROM dataset_versions ORDER BY id`)
		require.NoError(t, err)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		require.NoError(t, err)
		return ids
	}
	all := versions()
	require.Len(t, all, 3, "the first, second and third runs each wrote raw")

	// Within RETENTION nothing goes; past it, the runs kept keep theirs.
	require.Zero(t, h.deleteExpiredVersions())
	h.age()
	require.Zero(t, h.deleteExpiredVersions())

	// The first run is gone, but the memoized run's node a still reads
	// the task that wrote its version; the second's version is read by
	// nothing.
	h.age(first, second)
	require.Equal(t, 2, h.deleteExpiredRuns(100))
	require.Equal(t, 1, h.deleteExpiredVersions())
	require.Equal(t, []int64{all[0], all[2]}, versions())

	// Once the memoized run is gone too, only the newest version is left,
	// though its run is gone as well.
	h.age(memo, third)
	require.Equal(t, 2, h.deleteExpiredRuns(100))
	require.Equal(t, 1, h.deleteExpiredVersions())
	require.Equal(t, []int64{all[2]}, versions())

	// A running run's task that read a version keeps it, once newer ones
	// are written and the run that wrote it is gone.
	applyFile(t, h.db, h.p, fmt.Sprintf(diamondFile, job.FailStop)+`
  - name: reader
    nodes:
      - {job: b, input_datasets: [raw]}
`)
	reader, err := h.store.StartRun(context.Background(), h.p, "reader", job.RunRequest{})
	require.NoError(t, err)
	fourth := h.completeRun(`{"day": 4}`)
	h.age(third, fourth)
	require.Equal(t, 1, h.deleteExpiredRuns(100), "the third run goes")
	require.Zero(t, h.deleteExpiredVersions())
	require.Equal(t, job.RunRunning, h.run(reader.ID).Status)
	require.Len(t, versions(), 2)
}

// A node whose task retention deleted shows how that task ended, not
// SUBMITTED as if it never ran.
func TestRetentionKeepsHowANodeEnded(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailContinue)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
	tasks := h.nodeTasks(run.ID)
	h.settle(tasks["b"].ID, task.Fail, "")
	h.settle(tasks["c"].ID, task.Complete, `{}`)
	want := map[string]string{"a": "COMPLETED", "b": "FAILED", "c": "COMPLETED", "d": "SKIPPED"}
	r := h.run(run.ID)
	require.Equal(t, job.RunFailed, r.Status)
	require.Equal(t, want, nodeStatus(r))

	h.expire(tasks["a"].ID, tasks["b"].ID, tasks["c"].ID)
	require.Empty(t, h.nodeTasks(run.ID), "retention deleted the run's tasks")
	require.Equal(t, want, nodeStatus(h.run(run.ID)))
}

// Retention of runs and dataset versions reads those past RETENTION
// through an index, however many ended within it: a scan of every run (or
// version) at every pass would grow with the history retention keeps. And
// a batch of a backlog deletes its rows by their key: joined to all the
// expired ones again, each batch would read the whole backlog.
func TestRunRetentionReadsOnlyWhatExpired(t *testing.T) {
	b := setupStores(t)
	// expired makes n runs that ended ago, each with a task and a version
	// of one dataset, and returns the plans of both retention statements.
	expired := func(n int, ago string) []string {
		b.exec(t, `INSERT INTO workflow_runs (id, org_id, workflow, status, on_failure, memoize, finished_at)
			SELECT gen_random_uuid(), `+testdb.OrgSQL+`, 'w', 'COMPLETED', 'stop', false, now() - $2::interval
			FROM generate_series(1, $1)`, n, ago)
		b.exec(t, `INSERT INTO dataset_versions (org_id, dataset, run_id, node, task_id, created_at)
			SELECT org_id, 'raw', id, 'a', gen_random_uuid(), finished_at FROM workflow_runs
			WHERE NOT EXISTS (SELECT 1 FROM dataset_versions v WHERE v.run_id = workflow_runs.id)`)
		b.exec(t, `INSERT INTO tasks (id, org_id, type, status, completed_at, run_id, node)
			SELECT task_id, org_id, 'demo.noop', 'COMPLETED', now(), run_id, node FROM dataset_versions
			WHERE NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = dataset_versions.task_id)`)
		b.exec(t, `INSERT INTO run_nodes (run_id, node, org_id, position, job, state, task_id)
			SELECT run_id, node, org_id, 0, 'a', 'SUBMITTED', task_id FROM dataset_versions
			WHERE NOT EXISTS (SELECT 1 FROM run_nodes n WHERE n.task_id = dataset_versions.task_id)`)
		// Versions of another dataset that the tasks read.
		b.exec(t, `INSERT INTO task_inputs (task_id, org_id, input_dataset, input_version)
			SELECT task_id, org_id, 'other', -id FROM dataset_versions
			WHERE NOT EXISTS (SELECT 1 FROM task_inputs i WHERE i.task_id = dataset_versions.task_id)`)
		for _, table := range []string{"workflow_runs", "dataset_versions", "tasks", "run_nodes", "task_inputs"} {
			b.exec(t, `ANALYZE `+table)
		}
		retention := int64(7 * 24 * time.Hour / time.Millisecond)
		var plans []string
		for _, name := range []string{"workflow_runs.delete_expired", "dataset_versions.delete_expired"} {
			plans = append(plans, name+"\n"+b.explain(t, statementSQL(t, name), retention, 1000))
		}
		return plans
	}
	for i, plan := range expired(20000, "1 hour") {
		require.Contains(t, plan, []string{"using workflow_runs_finished", "using dataset_versions_created"}[i], plan)
		require.NotContains(t, plan, "Seq Scan", plan)
	}
	for _, plan := range expired(20000, "10 days") {
		require.Contains(t, plan, "Index Cond: (id = ANY", plan)
		require.NotContains(t, plan, "Seq Scan on run_nodes", plan)
		require.NotContains(t, plan, "Seq Scan on dataset_versions", plan)
	}
}

// A task of a run that retention deleted (the run ended, and the task,
// asked to stop, ended after it) is retried on its own: its own retry
// answered 409, telling to retry the run, which is gone (404).
func TestTaskOfADeletedRunIsRetriedAlone(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{"a": 1}`)
	tasks := h.nodeTasks(run.ID)
	h.settle(tasks["b"].ID, task.Fail, "")
	h.settle(tasks["c"].ID, task.Fail, "")
	require.Equal(t, job.RunFailed, h.run(run.ID).Status)
	api := postgres.NewAPIStore(h.db.Pool, nil)
	_, err = api.Retry(ctx, h.p, tasks["c"].ID, nil)
	require.Equal(t, task.ErrCodeConflict, task.ErrorCode(err), "while the run is there, it is retried with its run")
	h.exec(`UPDATE workflow_runs SET finished_at = now() - interval '8 days' WHERE id = $1`, run.ID)
	require.Equal(t, 1, h.deleteExpiredRuns(100))
	_, err = h.store.RetryRun(ctx, h.p, run.ID, nil)
	require.Equal(t, task.ErrCodeNotFound, task.ErrorCode(err), "the run is gone")

	got, err := api.Get(ctx, h.p, tasks["c"].ID)
	require.NoError(t, err)
	require.Equal(t, run.ID, *got.RunID, "the task still names its run")
	retried, err := api.Retry(ctx, h.p, tasks["c"].ID, nil)
	require.NoError(t, err)
	require.Equal(t, task.StatusPending, retried.Status)
	// It runs and ends as any task: no run moves, no version is written.
	h.settle(tasks["c"].ID, task.Complete, `{"c": 2}`)
	require.Equal(t, task.StatusCompleted, h.nodeTasks(run.ID)["c"].Status)
	require.Zero(t, h.count(`SELECT count(*) FROM dataset_versions WHERE task_id = $1`, tasks["c"].ID))
}

// A bulk retry takes, as the single retry does, the failed tasks of a run
// that retention deleted, and leaves those of a run still there to be
// retried with their run; its count reads the tasks through their index.
func TestBulkRetryTakesTasksOfADeletedRun(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	failRun := func(day string) (uuid.UUID, uuid.UUID) {
		// Runs of other parameters: a memoizes nothing for the second.
		run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: json.RawMessage(`{"day": "` + day + `"}`)})
		require.NoError(t, err)
		h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{"a": 1}`)
		tasks := h.nodeTasks(run.ID)
		h.settle(tasks["b"].ID, task.Fail, "")
		h.settle(tasks["c"].ID, task.Fail, "")
		require.Equal(t, job.RunFailed, h.run(run.ID).Status)
		return run.ID, tasks["c"].ID
	}
	gone, goneTask := failRun("2026-11-23")
	kept, keptTask := failRun("2026-11-24")
	h.exec(`UPDATE workflow_runs SET finished_at = now() - interval '8 days' WHERE id = $1`, gone)
	require.Equal(t, 1, h.deleteExpiredRuns(100))

	api := postgres.NewAPIStore(h.db.Pool, nil)
	res, err := api.Bulk(ctx, h.p, task.Bulk{Action: task.ActionRetry, Limit: task.MaxBulkLimit}, nil)
	require.NoError(t, err)
	require.Equal(t, 2, res.Changed, "b and c of the deleted run")
	require.Equal(t, 2, res.Matched)
	for id, want := range map[uuid.UUID]task.Status{goneTask: task.StatusPending, keptTask: task.StatusFailed} {
		got, err := api.Get(ctx, h.p, id)
		require.NoError(t, err)
		require.Equal(t, want, got.Status)
	}
	require.Equal(t, job.RunFailed, h.run(kept).Status)

	sql, args := postgres.BulkCountSQL(h.p.OrgID, task.ActionRetry, task.ActionRetry.Statuses(), task.Filter{})
	// The test's tables are small: the planner is told to avoid a scan
	// wherever an index can serve.
	tx, err := h.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SET LOCAL enable_seqscan = off`)
	require.NoError(t, err)
	plan := explainOn(t, tx, sql, args...)
	require.NotContains(t, plan, "Seq Scan on tasks", plan)
}

// A task an Idempotency-Key is being bound to while retention deletes it
// stays, with its key: the keyed request was answered with that task, and
// the same request sent again must get it too, not a second task. The
// binding's transaction holds the task's row (its key's reference) when
// retention comes to it, and commits while retention waits.
func TestRetentionKeepsATaskAKeyIsBoundToMeanwhile(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	id := b.pending(t, 1)
	l := b.claim(t, id, "w")
	b.apply(t, task.Change{TaskID: id, Version: l.Version, Transition: task.Complete, Result: json.RawMessage(`{}`)})
	b.exec(t, `UPDATE tasks SET completed_at = now() - interval '8 days' WHERE id = $1`, id)

	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `INSERT INTO task_idempotency_keys (org_id, type, key, task_id)
		SELECT org_id, type, 'order-7', id FROM tasks WHERE id = $1`, id)
	require.NoError(t, err)
	type deleted struct {
		n   int
		err error
	}
	done := make(chan deleted, 1)
	go func() {
		n, err := b.maint.DeleteExpired(ctx, 7*24*time.Hour, 100)
		done <- deleted{n, err}
	}()
	require.Eventually(t, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND query LIKE '%tasks.delete_expired%'`) == 1
	}, 10*time.Second, 10*time.Millisecond, "retention waits for the binding's lock")
	require.NoError(t, tx.Commit(ctx))

	got := <-done
	require.NoError(t, got.err)
	require.Zero(t, got.n, "the task's key was bound within retention")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM tasks WHERE id = $1`, id))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM task_idempotency_keys WHERE task_id = $1`, id))
}

// A keyed request that found an expired task by its input, and that
// retention deleted before the request bound its key, makes the task
// anew: the key's reference finds the task gone, and the request runs
// again, as after any race for a key, rather than fail as not found. The
// binding is held up by a trigger until retention has committed.
func TestKeyedRequestOutracedByRetentionMakesItsTask(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	submission := func(key string) task.Submission {
		t.Helper()
		sub, err := task.NewSubmission(task.SubmitInput{Type: "demo.noop", Payload: json.RawMessage(`{"n": 1}`),
			IdempotencyKey: key}, task.Defaults{MaxAttempts: 3}, "")
		require.NoError(t, err)
		return sub
	}
	first, err := b.api.Submit(ctx, b.admin, submission(""), nil)
	require.NoError(t, err)
	l := b.claim(t, first.Task.ID, "w")
	b.apply(t, task.Change{TaskID: first.Task.ID, Version: l.Version, Transition: task.Complete, Result: json.RawMessage(`{}`)})
	b.exec(t, `UPDATE tasks SET completed_at = now() - interval '8 days' WHERE id = $1`, first.Task.ID)

	// The binding waits for an advisory lock this test holds.
	b.exec(t, `CREATE FUNCTION hold_binding() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_advisory_xact_lock_shared(4242); RETURN NEW; END $$`)
	b.exec(t, `CREATE TRIGGER hold_binding BEFORE INSERT ON task_idempotency_keys
		FOR EACH ROW EXECUTE FUNCTION hold_binding()`)
	b.exec(t, `GRANT EXECUTE ON FUNCTION hold_binding() TO PUBLIC`)
	hold, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = hold.Rollback(ctx) }()
	_, err = hold.Exec(ctx, `SELECT pg_advisory_xact_lock(4242)`)
	require.NoError(t, err)

	type submitted struct {
		out task.Submitted
		err error
	}
	done := make(chan submitted, 1)
	go func() {
		out, err := b.api.Submit(ctx, b.admin, submission("order-7"), nil)
		done <- submitted{out, err}
	}()
	require.Eventually(t, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event = 'advisory' AND query LIKE '%idempotency_keys.insert%'`) == 1
	}, 10*time.Second, 10*time.Millisecond, "the keyed request binds its key to the task it found")
	n, err := b.maint.DeleteExpired(ctx, 7*24*time.Hour, 100)
	require.NoError(t, err)
	require.Equal(t, 1, n, "no key was bound to the task yet")
	require.NoError(t, hold.Rollback(ctx))

	got := <-done
	require.NoError(t, got.err)
	require.True(t, got.out.Created, "the input's task is gone: the request makes it anew")
	require.NotEqual(t, first.Task.ID, got.out.Task.ID)
	require.Equal(t, got.out.Task.ID.String(), b.text(t,
		`SELECT task_id::text FROM task_idempotency_keys WHERE key = 'order-7'`))
}
