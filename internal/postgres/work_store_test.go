package postgres_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

type workBundle struct {
	db    *testdb.DB
	store *postgres.WorkStore
}

func setupWork(t *testing.T) *workBundle {
	t.Helper()
	t.Parallel()
	db := testdb.New(t)
	return &workBundle{db: db, store: postgres.NewWorkStore(db.Pool, nil)}
}

// pending inserts a PENDING task and returns its id.
func (b *workBundle) pending(t *testing.T, maxAttempts int) uuid.UUID {
	t.Helper()
	id := uuid.Must(uuid.NewV7())
	_, err := b.db.Pool.Exec(context.Background(),
		`INSERT INTO tasks (id, type, max_attempts) VALUES ($1, 'demo.noop', $2)`, id, maxAttempts)
	require.NoError(t, err)
	return id
}

func (b *workBundle) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	_, err := b.db.Pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

func (b *workBundle) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

func (b *workBundle) claim(t *testing.T, id uuid.UUID, worker string) task.Lease {
	t.Helper()
	tk, ok, err := b.store.Claim(context.Background(), id, worker, time.Hour)
	require.NoError(t, err)
	require.True(t, ok, "claim by %s", worker)
	return task.Lease{TaskID: id, WorkerID: worker, Attempt: tk.Attempt, Version: tk.Version}
}

func TestClaimIsExclusiveUnderConcurrency(t *testing.T) {
	b := setupWork(t)
	id := b.pending(t, 3)
	const claimers = 20
	won := make([]bool, claimers)
	var g errgroup.Group
	for i := range claimers {
		g.Go(func() error {
			tk, ok, err := b.store.Claim(context.Background(), id, fmt.Sprintf("w%d", i), time.Minute)
			won[i] = ok
			if ok && (tk.Attempt != 1 || tk.Status != task.StatusInProgress) {
				return fmt.Errorf("claimed task is %+v", tk)
			}
			return err
		})
	}
	require.NoError(t, g.Wait())
	winners := 0
	for _, w := range won {
		if w {
			winners++
		}
	}
	require.Equal(t, 1, winners)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM task_events WHERE task_id = $1 AND status = 'IN_PROGRESS'`, id))
}

func TestClaimRespectsLiveLeasesAndTakesExpiredOnes(t *testing.T) {
	b := setupWork(t)
	ctx := context.Background()
	id := b.pending(t, 3)
	first := b.claim(t, id, "w1")

	_, ok, err := b.store.Claim(ctx, id, "w2", time.Hour)
	require.NoError(t, err)
	require.False(t, ok, "a live lease is not taken")

	b.exec(t, `UPDATE tasks SET lease_expires_at = now() - interval '1 second' WHERE id = $1`, id)
	second := b.claim(t, id, "w2")
	require.Equal(t, 2, second.Attempt)

	// The first holder's next write misses, and it learns it lost the task.
	require.ErrorIs(t, b.store.RenewLease(ctx, &first, time.Hour), task.ErrFenced)
	hold, err := b.store.Inspect(ctx, id)
	require.NoError(t, err)
	require.False(t, hold.Owns(first))
	require.True(t, hold.Owns(second))
}

func TestFencedWritesFollowTheVersion(t *testing.T) {
	b := setupWork(t)
	ctx := context.Background()
	id := b.pending(t, 3)
	l := b.claim(t, id, "w1")

	v := l.Version
	require.NoError(t, b.store.Progress(ctx, &l, 40, "Step 2/5", time.Hour))
	require.Equal(t, v+1, l.Version)
	require.NoError(t, b.store.RenewLease(ctx, &l, time.Hour))

	// A cancel requested through the API moves the version on.
	b.exec(t, `UPDATE tasks SET cancel_requested_at = now(), version = version + 1 WHERE id = $1`, id)
	stale := l
	require.ErrorIs(t, b.store.Progress(ctx, &l, 60, "Step 3/5", time.Hour), task.ErrFenced)
	hold, err := b.store.Inspect(ctx, id)
	require.NoError(t, err)
	require.True(t, hold.Owns(l))
	require.True(t, hold.CancelRequested)
	l.Version = hold.Version
	require.NoError(t, b.store.FinishCancelled(ctx, &l))

	// Nothing written with the old version lands.
	require.ErrorIs(t, b.store.Complete(ctx, &stale, []byte(`{}`)), task.ErrFenced)
	require.ErrorIs(t, b.store.Complete(ctx, &l, []byte(`{}`)), task.ErrFenced, "terminal")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM tasks WHERE id = $1 AND status = 'CANCELLED' AND progress = 40`, id))
	require.Zero(t, b.count(t, `SELECT count(*) FROM task_results WHERE task_id = $1`, id))
}

func TestScheduledRetryWaitsForItsTime(t *testing.T) {
	b := setupWork(t)
	ctx := context.Background()
	id := b.pending(t, 3)
	l := b.claim(t, id, "w1")
	require.NoError(t, b.store.ScheduleRetry(ctx, &l, "boom", time.Hour, "", nil))

	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM outbox o JOIN tasks t ON t.id = o.task_id
		WHERE o.task_id = $1 AND o.available_at = t.next_run_at AND t.next_run_at > now() + interval '59 minutes'`, id))
	_, ok, err := b.store.Claim(ctx, id, "w2", time.Minute)
	require.NoError(t, err)
	require.False(t, ok, "an early delivery is dropped; the scheduled message brings it")

	b.exec(t, `UPDATE tasks SET next_run_at = now() WHERE id = $1`, id)
	require.Equal(t, 2, b.claim(t, id, "w2").Attempt)
}

func TestReapLeasesEndsEachAttemptRightly(t *testing.T) {
	b := setupWork(t)
	ctx := context.Background()
	retry, exhausted, cancelled := b.pending(t, 3), b.pending(t, 1), b.pending(t, 3)
	for _, id := range []uuid.UUID{retry, exhausted, cancelled} {
		b.claim(t, id, "dead")
	}
	b.exec(t, `UPDATE tasks SET cancel_requested_at = now() WHERE id = $1`, cancelled)
	b.exec(t, `UPDATE tasks SET lease_expires_at = now() - interval '1 second'`)

	got, err := b.store.ReapLeases(ctx, 100)
	require.NoError(t, err)
	require.Equal(t, map[task.Status]int{task.StatusPending: 1, task.StatusFailed: 1, task.StatusCancelled: 1}, got)
	status := func(id uuid.UUID) string {
		var s string
		require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT status FROM tasks WHERE id = $1`, id).Scan(&s))
		return s
	}
	require.Equal(t, "PENDING", status(retry))
	require.Equal(t, "FAILED", status(exhausted))
	require.Equal(t, "CANCELLED", status(cancelled))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM outbox WHERE task_id = $1`, retry), "re-queued")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM outbox`), "only the re-queued task")

	got, err = b.store.ReapLeases(ctx, 100)
	require.NoError(t, err)
	require.Empty(t, got, "idempotent")
}

func TestRepublishStaleOnlyWithoutAMessage(t *testing.T) {
	b := setupWork(t)
	ctx := context.Background()
	lost, queued, fresh := b.pending(t, 3), b.pending(t, 3), b.pending(t, 3)
	b.exec(t, `UPDATE tasks SET next_run_at = now() - interval '1 hour' WHERE id <> $1`, fresh)
	b.exec(t, `INSERT INTO outbox (kind, task_id, routing_key, body) VALUES ('task.run', $1, 'demo.noop', '{}')`, queued)

	n, err := b.store.RepublishStale(ctx, time.Minute, 100)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM outbox WHERE task_id = $1`, lost))
	n, err = b.store.RepublishStale(ctx, time.Minute, 100)
	require.NoError(t, err)
	require.Zero(t, n, "its next_run_at moved on")
}

func TestRetentionDeletesOldTerminalTasksWithTheirHistory(t *testing.T) {
	b := setupWork(t)
	ctx := context.Background()
	old, recent, running := b.pending(t, 3), b.pending(t, 3), b.pending(t, 3)
	for _, id := range []uuid.UUID{old, recent} {
		l := b.claim(t, id, "w")
		require.NoError(t, b.store.Complete(ctx, &l, []byte(`{"ok": true}`)))
	}
	b.claim(t, running, "w")
	b.exec(t, `UPDATE tasks SET completed_at = now() - interval '8 days' WHERE id = $1`, old)

	n, err := b.store.DeleteExpired(ctx, 7*24*time.Hour, 100)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Zero(t, b.count(t, `SELECT count(*) FROM task_events WHERE task_id = $1`, old))
	require.Zero(t, b.count(t, `SELECT count(*) FROM task_results WHERE task_id = $1`, old))
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM tasks`))
}

func TestLeadershipIsHeldByOneAtATime(t *testing.T) {
	b := setupWork(t)
	ctx := context.Background()
	elect := func(id string) bool {
		ok, err := b.store.Elect(ctx, "maintenance", id, time.Minute)
		require.NoError(t, err)
		return ok
	}
	require.True(t, elect("a"))
	require.False(t, elect("b"))
	require.True(t, elect("a"), "the leader extends its term")

	b.exec(t, `UPDATE leaders SET expires_at = now() - interval '1 second'`)
	require.True(t, elect("b"), "an expired leadership is taken")
	require.False(t, elect("a"))

	require.NoError(t, b.store.Resign(ctx, "maintenance", "b"))
	require.True(t, elect("a"), "a resigned leadership is free at once")
}

func TestWorkerRegistry(t *testing.T) {
	b := setupWork(t)
	ctx := context.Background()
	require.NoError(t, b.store.RegisterWorker(ctx, postgres.WorkerInfo{ID: "w1", Hostname: "h", PID: 1, Concurrency: 4, Types: []string{"demo.noop"}}))
	ok, err := b.store.WorkerHeartbeat(ctx, "w1")
	require.NoError(t, err)
	require.True(t, ok)
	b.exec(t, `UPDATE workers SET last_heartbeat_at = now() - interval '1 hour'`)
	n, err := b.store.ReapWorkers(ctx, time.Minute)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	ok, err = b.store.WorkerHeartbeat(ctx, "w1")
	require.NoError(t, err)
	require.False(t, ok, "a worker removed as dead learns it must register again")
}
