package worker

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	oteltrace "go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/job"
	"github.com/conveyorhq/conveyor/internal/task"
)

// fakeMaintenanceStore serves stale tasks and records the changes applied.
type fakeMaintenanceStore struct {
	mu      sync.Mutex
	stale   []task.Standing
	expired []task.Standing
	applied []task.Change
	// parked are the types of the parked messages; released those
	// ReleaseParked was given.
	parked   []string
	released []string
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
func (s *fakeMaintenanceStore) HeartbeatExpired(context.Context, time.Duration, int) ([]task.Standing, []time.Duration, error) {
	return nil, nil, nil
}
func (s *fakeMaintenanceStore) StalePending(context.Context, time.Duration, int, []string) ([]task.Standing, error) {
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
func (s *fakeMaintenanceStore) DeleteExpiredRuns(context.Context, time.Duration, int) (int, error) {
	return 0, nil
}
func (s *fakeMaintenanceStore) DeleteExpiredVersions(context.Context, time.Duration, int) (int, error) {
	return 0, nil
}
func (s *fakeMaintenanceStore) ParkedTypes(context.Context, time.Duration) ([]string, error) {
	return s.parked, nil
}
func (s *fakeMaintenanceStore) ReleaseParked(_ context.Context, types []string) (int, error) {
	s.released = append(s.released, types...)
	return len(types), nil
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

// Parked messages are released only for types whose queue exists: a live
// worker that could not declare its queues (one of them exists with other
// arguments) would have them published and parked again at every pass.
func TestMaintenanceReleasesParkedMessagesOnlyOfDeclaredQueues(t *testing.T) {
	t.Parallel()
	store := &fakeMaintenanceStore{parked: []string{"t.declared", "t.missing"}}
	m := newTestMaintainer(store, QueuesFunc(func(_ context.Context, typ string) (int, bool, error) {
		return 0, typ == "t.declared", nil
	}))
	m.RunOnce(context.Background())
	require.Equal(t, []string{"t.declared"}, store.released)
}

// A backlog of stale tasks of one type, waiting behind its non-empty queue,
// does not hide the lost tasks of another type: however many tasks of the
// busy type are older, the tasks of the type whose queue is empty are
// published again.
func TestMaintenanceRepublishesLostTasksBehindABacklogOfAnotherType(t *testing.T) {
	t.Parallel()
	store := &limitedStaleStore{}
	// 250 stale tasks of a busy type (more than two batches of 100), due
	// first; then 3 whose messages were lost.
	for range 250 {
		store.stale = append(store.stale, task.Standing{ID: uuid.New(), Type: "t.busy", Version: 2})
	}
	lost := map[uuid.UUID]bool{}
	for range 3 {
		id := uuid.New()
		lost[id] = true
		store.stale = append(store.stale, task.Standing{ID: id, Type: "t.lost", Version: 2})
	}
	ready := map[string]int{"t.busy": 5000, "t.lost": 0}
	m := newTestMaintainer(store, QueuesFunc(func(_ context.Context, typ string) (int, bool, error) {
		return ready[typ], true, nil
	}))
	m.RunOnce(context.Background())
	store.mu.Lock()
	defer store.mu.Unlock()
	got := map[uuid.UUID]bool{}
	for _, c := range store.applied {
		require.Equal(t, task.Republish, c.Transition)
		got[c.TaskID] = true
	}
	require.Equal(t, lost, got, "the lost tasks are republished, and only they")
}

// limitedStaleStore serves stale tasks as the database does: at most limit
// of them, oldest first, none of the types skipped; a task republished is
// no longer stale.
type limitedStaleStore struct {
	fakeMaintenanceStore
}

func (s *limitedStaleStore) StalePending(_ context.Context, _ time.Duration, limit int, skip []string) ([]task.Standing, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	moved := map[uuid.UUID]bool{}
	skipped := map[string]bool{}
	for _, typ := range skip {
		skipped[typ] = true
	}
	for _, c := range s.applied {
		moved[c.TaskID] = true
	}
	var out []task.Standing
	for _, st := range s.stale {
		if len(out) == limit {
			break
		}
		if !moved[st.ID] && !skipped[st.Type] {
			out = append(out, st)
		}
	}
	return out, nil
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

// cronStore records the context each cron pass writes its ticks with; its
// passes fail with err when set, and find nothing due when idle.
type cronStore struct {
	passes []context.Context
	err    error
	idle   bool
}

func (s *cronStore) Cron(ctx context.Context, cfg job.CronConfig, _ time.Time) (job.CronStats, error) {
	if s.err != nil {
		return job.CronStats{}, s.err
	}
	if s.idle {
		return job.CronStats{}, nil
	}
	// Two ticks are due, as the store finds them: the pass's trace starts
	// before they are written.
	if cfg.Trace != nil {
		ctx = cfg.Trace(ctx)
	}
	s.passes = append(s.passes, ctx)
	return job.CronStats{Made: 2}, nil
}
func (s *cronStore) Admit(context.Context, job.AdmitConfig) (job.AdmitStats, error) {
	return job.AdmitStats{}, nil
}
func (s *cronStore) CancelStopped(context.Context, int) (int, error) { return 0, nil }
func (s *cronStore) WakeParents(context.Context, int) (int, error)   { return 0, nil }

// The tasks of cron ticks are traced like submitted ones: each pass of the
// scheduler runs under a root span of its own, whose context the store
// writes on the ticks' tasks and messages, so that the relay's and the
// worker's spans of a tick's task join it.
func TestSchedulerTracesItsCronPasses(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	store := &cronStore{}
	s := NewScheduler(SchedulerConfig{Interval: time.Second, CronEvery: time.Millisecond}, store,
		func() bool { return true }, slog.New(slog.NewTextHandler(io.Discard, nil)), NewMetrics(prometheus.NewRegistry()), tp)
	s.RunOnce(context.Background())
	require.Len(t, store.passes, 1)
	sc := oteltrace.SpanContextFromContext(store.passes[0])
	require.True(t, sc.IsValid(), "the cron pass hands the store a trace for its ticks' tasks")
	ended := rec.Ended()
	require.Len(t, ended, 1)
	require.Equal(t, "cron", ended[0].Name())
	require.False(t, ended[0].Parent().IsValid(), "a pass starts a trace")
	require.Equal(t, sc.TraceID(), ended[0].SpanContext().TraceID())
}

// A cron pass runs every few hundred milliseconds; one that finds nothing
// due leaves no trace. A trace of its own for each, several a second, would
// bury the traces of the tasks in the tracing backend.
func TestSchedulerTracesNoIdleCronPass(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	store := &cronStore{idle: true}
	s := NewScheduler(SchedulerConfig{Interval: time.Second, CronEvery: time.Millisecond}, store,
		func() bool { return true }, slog.New(slog.NewTextHandler(io.Discard, nil)), NewMetrics(prometheus.NewRegistry()), tp)
	for range 3 {
		s.cronAt = time.Time{}
		s.RunOnce(context.Background())
	}
	require.Empty(t, rec.Ended(), "no span for passes that found nothing due")
	require.Empty(t, rec.Started())
}

// A cron pass that failed (its ticks' tasks were not made) is an error in
// its trace, not a pass like any other.
func TestSchedulerMarksAFailedCronPassAsAnError(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	store := &cronStore{err: errors.New("connection refused")}
	s := NewScheduler(SchedulerConfig{Interval: time.Second, CronEvery: time.Millisecond}, store,
		func() bool { return true }, slog.New(slog.NewTextHandler(io.Discard, nil)), NewMetrics(prometheus.NewRegistry()), tp)
	s.RunOnce(context.Background())
	ended := rec.Ended()
	require.Len(t, ended, 1)
	require.Equal(t, codes.Error, ended[0].Status().Code)
	require.Contains(t, ended[0].Status().Description, "connection refused")
}

// admitStore answers each admission pass with the next of its stats.
type admitStore struct {
	cronStore
	passes []job.AdmitStats
}

func (s *admitStore) Admit(context.Context, job.AdmitConfig) (job.AdmitStats, error) {
	st := s.passes[0]
	s.passes = s.passes[1:]
	return st, nil
}

// A pass that found the scheduler's lock held (a pause or an apply under
// way) looked at nothing: it does not log the types in fair mode as
// admitting directly again, nor log them going back into fair mode at the
// next pass.
func TestSchedulerKeepsTheModesOfAPassThatDidNotLook(t *testing.T) {
	t.Parallel()
	store := &admitStore{passes: []job.AdmitStats{{Fair: []string{"busy.t"}}, {Busy: true}, {Fair: []string{"busy.t"}}}}
	var logs bytes.Buffer
	s := NewScheduler(SchedulerConfig{Interval: time.Second, CronEvery: time.Hour}, store,
		func() bool { return true }, slog.New(slog.NewTextHandler(&logs, nil)), NewMetrics(prometheus.NewRegistry()),
		sdktrace.NewTracerProvider())
	for range 3 {
		s.RunOnce(context.Background())
	}
	require.Equal(t, 1, strings.Count(logs.String(), "type in fair mode"), logs.String())
	require.NotContains(t, logs.String(), "type admits directly again")
}

// electionStore is a maintenance store whose elections go as told.
type electionStore struct {
	fakeMaintenanceStore
	leader bool
}

func (s *electionStore) Elect(context.Context, string, string, time.Duration) (bool, error) {
	return s.leader, nil
}

// conveyor_workers_live is the maintenance leader's count: a worker that
// lost the leadership stops reporting its last count, which would
// otherwise stay as it was forever (the dashboard's max() of it then shows
// workers long gone).
func TestAWorkerThatLosesTheLeadershipStopsCountingWorkers(t *testing.T) {
	t.Parallel()
	store := &electionStore{leader: true}
	m := newTestMaintainer(store, QueuesFunc(func(context.Context, string) (int, bool, error) { return 0, true, nil }))
	m.tick(context.Background())
	require.Equal(t, 1.0, gaugeValue(t, m.metrics.liveWorkers), "the leader counts the workers")
	store.leader = false
	m.tick(context.Background())
	require.Zero(t, gaugeValue(t, m.metrics.leader))
	require.Zero(t, gaugeValue(t, m.metrics.liveWorkers), "a deposed leader's count is not the current one")
}

func gaugeValue(t *testing.T, g prometheus.Gauge) float64 {
	t.Helper()
	var m dto.Metric
	require.NoError(t, g.Write(&m))
	return m.GetGauge().GetValue()
}

// timedStore records when each admission pass ran.
type timedStore struct {
	cronStore
	passes chan time.Time
	takes  time.Duration // how long a pass takes
}

func (s *timedStore) Admit(context.Context, job.AdmitConfig) (job.AdmitStats, error) {
	s.passes <- time.Now()
	time.Sleep(s.takes)
	return job.AdmitStats{}, nil
}

// schedulerPasses runs an idle scheduler whose passes each take takes, and
// returns when its first n passes began.
func schedulerPasses(t *testing.T, interval, minInterval, takes time.Duration, n int) []time.Time {
	t.Helper()
	store := &timedStore{cronStore: cronStore{idle: true}, passes: make(chan time.Time, 16), takes: takes}
	s := NewScheduler(SchedulerConfig{Interval: interval, MinInterval: minInterval, CronEvery: time.Hour,
		Admit: job.AdmitConfig{MaxAdmit: 100}}, store,
		func() bool { return true }, slog.New(slog.NewTextHandler(io.Discard, nil)), NewMetrics(prometheus.NewRegistry()),
		sdktrace.NewTracerProvider())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	within := 5 * (interval + minInterval + takes)
	var at []time.Time
	for range n {
		select {
		case p := <-store.passes:
			at = append(at, p)
		case <-time.After(within):
			t.Fatalf("no pass within %s", within)
		}
	}
	return at
}

// An idle scheduler passes every SCHEDULER_INTERVAL, as the README says,
// not every SCHEDULER_MIN_INTERVAL + SCHEDULER_INTERVAL: the minimum's wait
// after a pass is part of the interval, not added to it.
func TestAnIdleSchedulerPassesEveryInterval(t *testing.T) {
	t.Parallel()
	const interval, minInterval = 400 * time.Millisecond, 300 * time.Millisecond
	at := schedulerPasses(t, interval, minInterval, 0, 5)
	// The mean gap, not each one: on a busy machine a pass can start a
	// good part of the margin late, or record its time late, while the
	// mean of four gaps still tells an interval (400 ms) from a minimum
	// added to it (700 ms) or a minimum alone (300 ms).
	gaps := make([]time.Duration, 0, len(at)-1)
	for i := 1; i < len(at); i++ {
		gaps = append(gaps, at[i].Sub(at[i-1]))
	}
	mean := at[len(at)-1].Sub(at[0]) / time.Duration(len(gaps))
	require.GreaterOrEqual(t, mean, interval-minInterval/6, "passes came every %s on average: %v", mean, gaps)
	require.Less(t, mean, interval+minInterval/2, "passes came every %s on average: %v", mean, gaps)
}

// A pass slower than the interval is followed by a minimum's rest, not by
// the next pass at once: a slow database does not get passes back to back.
func TestASlowSchedulerPassIsFollowedByARest(t *testing.T) {
	t.Parallel()
	const interval, minInterval, takes = 100 * time.Millisecond, 150 * time.Millisecond, 300 * time.Millisecond
	at := schedulerPasses(t, interval, minInterval, takes, 3)
	for i := 1; i < len(at); i++ {
		require.GreaterOrEqual(t, at[i].Sub(at[i-1]), takes+minInterval-20*time.Millisecond, "pass %d", i)
	}
}
