package worker

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/registry"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// On PostgreSQL: a task on its last attempt whose handler ignores
// ErrShutdown is handed back by the stopping worker, its attempt given
// back, rather than left IN_PROGRESS for the lease reaper, which would
// fail it.
func TestWorkerHandsBackOnPostgresATaskWhoseHandlerIgnoresTheShutdown(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL")
	}
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	id := uuid.Must(uuid.NewV7())
	_, err := db.Pool.Exec(ctx, `INSERT INTO tasks (id, org_id, type, max_attempts) VALUES ($1, `+testdb.OrgSQL+`, 't.block', 1)`, id)
	require.NoError(t, err)

	h := newBlocking()
	h.ignore = true
	t.Cleanup(func() { close(h.release) })
	broker := newFakeBroker()
	deps := fakeDeps(nil, broker)
	deps.Store = postgres.NewWorkerStore(db.Pool, nil)
	w, err := New(Config{
		Info: registry.Worker{ID: "w1"}, Concurrency: 1, Lease: time.Second, Heartbeat: 100 * time.Millisecond,
		ProgressInterval: 10 * time.Millisecond, BackoffBase: time.Millisecond, BackoffMax: 10 * time.Millisecond,
		ShutdownTimeout: 100 * time.Millisecond, MaxRunTime: time.Hour, LongAfter: time.Hour,
		ReconnectBackoffMax: 10 * time.Millisecond,
	}, deps, []conveyor.Handler{conveyor.Handle("t.block", h.handle)})
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(runCtx) }()
	t.Cleanup(func() { stop(); <-done })
	src := receive(t, broker.made)

	a := newAcker()
	src.deliveries <- outbox.Delivery{Body: outbox.Body{TaskID: id, Type: "t.block"}, Acknowledger: a}
	receive(t, h.entered)
	stop() // SIGTERM
	select {
	case <-done:
	case <-time.After(waitLimit):
		t.Fatal("the worker did not stop")
	}

	var status string
	var attempt int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT status, attempt FROM tasks WHERE id = $1`, id).Scan(&status, &attempt))
	require.Equal(t, "PENDING", status, "the task is handed back, not left to its lease")
	require.Zero(t, attempt, "its attempt is given back")
	require.Equal(t, "ack", a.how())
}

// On PostgreSQL: a task whose lease expired is queued again after the
// backoff its attempt would have had had it failed, its message held back
// as long: a task that brings its worker down is not run again at once on
// the next worker, and the next.
func TestReapedTaskIsDueAfterItsAttemptsBackoff(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL")
	}
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	first, third := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	for id, attempt := range map[uuid.UUID]int{first: 1, third: 3} {
		_, err := db.Pool.Exec(ctx, `INSERT INTO tasks (id, org_id, type, max_attempts, status, state, attempt,
			worker_id, started_at, lease_expires_at) VALUES ($1, `+testdb.OrgSQL+`, 't.crash', 5, 'IN_PROGRESS',
			'RUNNING', $2, 'gone', now(), now() - interval '1 second')`, id, attempt)
		require.NoError(t, err)
	}

	m := NewMaintainer(MaintenanceConfig{WorkerID: "w", Interval: time.Second, LeaderTTL: 3 * time.Second,
		RepublishAfter: time.Hour, Retention: time.Hour, DeadAfter: time.Hour, BatchSize: 100,
		BackoffBase: 10 * time.Second, BackoffMax: time.Hour},
		postgres.NewMaintenanceStore(db.Pool, nil), QueuesFunc(func(context.Context, string) (int, bool, error) { return 0, true, nil }),
		slog.New(slog.NewTextHandler(io.Discard, nil)), NewMetrics(prometheus.NewRegistry()))
	m.RunOnce(ctx)

	// Attempt 1 waits 5–10 s, attempt 3 (10 s doubled twice) 20–40 s.
	for id, want := range map[uuid.UUID][2]float64{first: {4, 10.5}, third: {19, 40.5}} {
		var status string
		var due, available float64
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT t.status, extract(epoch FROM t.next_run_at - now()),
			extract(epoch FROM o.available_at - now())
			FROM tasks t JOIN outbox o ON o.task_id = t.id AND o.kind = 'task.run' WHERE t.id = $1`, id).
			Scan(&status, &due, &available))
		require.Equal(t, "PENDING", status)
		require.True(t, due > want[0] && due < want[1], "due in %.1f s, want %v", due, want)
		require.True(t, available > want[0] && available < want[1], "message available in %.1f s, want %v", available, want)
	}
}

// On PostgreSQL: a handler that goes silent past its task's heartbeat
// timeout is stopped before the task can run again. Its second attempt (on
// another worker) must not start while the first one's handler still runs,
// whatever the maintenance leader does meanwhile: two attempts of a task at
// once would break its job's concurrency limit, and run its work twice.
func TestASilentHandlerStopsBeforeItsTaskRunsAgain(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL")
	}
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	id := uuid.Must(uuid.NewV7())
	_, err := db.Pool.Exec(ctx, `INSERT INTO tasks (id, org_id, type, max_attempts, heartbeat_timeout_ms)
		VALUES ($1, `+testdb.OrgSQL+`, 't.silent', 2, 300)`, id)
	require.NoError(t, err)

	// The handler never reports progress, and stops only when told to.
	causes := make(chan error, 1)
	running := make(chan struct{})
	handler := func(ctx context.Context, _ conveyor.Task, _ conveyor.Reporter) (any, error) {
		close(running)
		<-ctx.Done()
		causes <- context.Cause(ctx)
		return nil, context.Cause(ctx)
	}
	broker := newFakeBroker()
	deps := fakeDeps(nil, broker)
	deps.Store = postgres.NewWorkerStore(db.Pool, nil)
	// A lease renewal comes only every few seconds: the worker learns late,
	// from its own writes, that someone else moved the task on.
	w, err := New(Config{
		Info: registry.Worker{ID: "w1"}, Concurrency: 1, Lease: 20 * time.Second, Heartbeat: 5 * time.Second,
		ProgressInterval: 10 * time.Millisecond, BackoffBase: time.Millisecond, BackoffMax: time.Millisecond,
		ShutdownTimeout: 100 * time.Millisecond, MaxRunTime: time.Hour, LongAfter: time.Hour,
		ReconnectBackoffMax: 10 * time.Millisecond,
	}, deps, []conveyor.Handler{conveyor.Handle("t.silent", handler)})
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(runCtx) }()
	t.Cleanup(func() { stop(); <-done })
	src := receive(t, broker.made)
	src.deliveries <- outbox.Delivery{Body: outbox.Body{TaskID: id, Type: "t.silent"}, Acknowledger: newAcker()}
	receive(t, running)

	m := NewMaintainer(MaintenanceConfig{WorkerID: "w1", Interval: time.Second, LeaderTTL: 3 * time.Second,
		RepublishAfter: time.Hour, Retention: time.Hour, DeadAfter: time.Hour, BatchSize: 100,
		BackoffBase: time.Millisecond, BackoffMax: time.Millisecond, Lease: 20 * time.Second},
		postgres.NewMaintenanceStore(db.Pool, nil), QueuesFunc(func(context.Context, string) (int, bool, error) { return 0, true, nil }),
		slog.New(slog.NewTextHandler(io.Discard, nil)), NewMetrics(prometheus.NewRegistry()))
	other := postgres.NewWorkerStore(db.Pool, nil)
	var cause error
	deadline := time.Now().Add(waitLimit)
	for cause == nil {
		require.True(t, time.Now().Before(deadline), "the task never ran again")
		m.RunOnce(ctx)
		claimed, err := other.Claim(ctx, []uuid.UUID{id}, "w2", time.Minute)
		require.NoError(t, err)
		select {
		case cause = <-causes:
		default:
		}
		if len(claimed) > 0 {
			require.NotNil(t, cause, "attempt %d started on w2 while the first attempt's handler still ran", claimed[0].Attempt)
			require.Equal(t, 2, claimed[0].Attempt)
		}
		time.Sleep(20 * time.Millisecond)
	}
	require.ErrorIs(t, cause, conveyor.ErrTimeout, "the silent handler is stopped as timed out")
	// The attempt failed as timed out, retried (a second attempt may have
	// started already).
	var errText string
	for time.Now().Before(deadline) {
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT coalesce(string_agg(error, ','), '') FROM task_events
			WHERE task_id = $1 AND status = 'PENDING' AND error IS NOT NULL`, id).Scan(&errText))
		if errText != "" {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	require.Contains(t, errText, "heartbeat timed out")
}
