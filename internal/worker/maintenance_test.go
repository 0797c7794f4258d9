package worker

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/task"
)

// fakeMaintenanceStore serves stale tasks and records the changes applied.
type fakeMaintenanceStore struct {
	mu      sync.Mutex
	stale   []task.Standing
	expired []task.Standing
	applied []task.Change
}

func (s *fakeMaintenanceStore) Elect(context.Context, string, string, time.Duration) (bool, error) {
	return true, nil
}
func (s *fakeMaintenanceStore) Resign(context.Context, string, string) error { return nil }
func (s *fakeMaintenanceStore) ExpiredLeases(context.Context, int) ([]task.Standing, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.expired
	s.expired = nil
	return out, nil
}
func (s *fakeMaintenanceStore) HeartbeatExpired(context.Context, int) ([]task.Standing, []time.Duration, error) {
	return nil, nil, nil
}
func (s *fakeMaintenanceStore) StalePending(context.Context, time.Duration, int) ([]task.Standing, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stale, nil
}
func (s *fakeMaintenanceStore) Apply(_ context.Context, changes []task.Change) ([]task.Applied, []error, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.applied = append(s.applied, changes...)
	return make([]task.Applied, len(changes)), make([]error, len(changes)), nil
}
func (s *fakeMaintenanceStore) DeleteExpired(context.Context, time.Duration, int) (int, error) {
	return 0, nil
}
func (s *fakeMaintenanceStore) ReleaseParked(context.Context, time.Duration) (int, error) {
	return 0, nil
}
func (s *fakeMaintenanceStore) ReapWorkers(context.Context, time.Duration) (int, error) {
	return 0, nil
}
func (s *fakeMaintenanceStore) CountWorkers(context.Context) (int, error) { return 1, nil }

func newTestMaintainer(store MaintenanceStore, queues Queues) *Maintainer {
	return NewMaintainer(MaintenanceConfig{WorkerID: "w", Interval: time.Second, LeaderTTL: 3 * time.Second,
		RepublishAfter: time.Minute, Retention: time.Hour, DeadAfter: time.Minute, BatchSize: 100},
		store, queues, slog.New(slog.NewTextHandler(io.Discard, nil)), NewMetrics(prometheus.NewRegistry()))
}

// Stale tasks are published again only for a type whose queue holds no
// ready message: a non-empty queue means the workers are still working
// through a backlog (or none runs), and publishing more would feed it.
func TestMaintenanceRepublishesOnlyBehindAnEmptyQueue(t *testing.T) {
	t.Parallel()
	busy, lost, gone := uuid.New(), uuid.New(), uuid.New()
	store := &fakeMaintenanceStore{stale: []task.Standing{
		{ID: busy, Type: "t.busy", Version: 3}, {ID: lost, Type: "t.empty", Version: 4}, {ID: gone, Type: "t.missing", Version: 5},
	}}
	ready := map[string]int{"t.busy": 120, "t.empty": 0}
	m := newTestMaintainer(store, QueuesFunc(func(_ context.Context, typ string) (int, bool, error) {
		n, ok := ready[typ]
		return n, ok, nil
	}))
	m.RunOnce(context.Background())
	require.Len(t, store.applied, 2)
	for _, c := range store.applied {
		require.Equal(t, task.Republish, c.Transition)
		require.NotEqual(t, busy, c.TaskID)
	}
}

// Expired leases are ended as the lifecycle says.
func TestMaintenanceEndsExpiredLeases(t *testing.T) {
	t.Parallel()
	store := &fakeMaintenanceStore{expired: []task.Standing{
		{ID: uuid.New(), Attempt: 1, MaxAttempts: 3},
		{ID: uuid.New(), Attempt: 3, MaxAttempts: 3},
		{ID: uuid.New(), Attempt: 1, MaxAttempts: 3, CancelPending: true},
	}}
	m := newTestMaintainer(store, QueuesFunc(func(context.Context, string) (int, bool, error) { return 0, true, nil }))
	m.RunOnce(context.Background())
	var got []task.Transition
	for _, c := range store.applied {
		got = append(got, c.Transition)
	}
	require.Equal(t, []task.Transition{task.ExpireRequeue, task.ExpireFail, task.ExpireCancel}, got)
}
