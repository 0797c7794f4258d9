package worker

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
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
