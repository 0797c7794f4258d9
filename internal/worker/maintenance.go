package worker

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/conveyorhq/conveyor/internal/registry"
	"github.com/conveyorhq/conveyor/internal/task"
)

// MaintenanceStore is the database as the maintenance leader needs it.
type MaintenanceStore interface {
	Elect(ctx context.Context, name, id string, ttl time.Duration) (bool, error)
	Resign(ctx context.Context, name, id string) error
	ExpiredLeases(ctx context.Context, limit int) ([]task.Standing, error)
	// HeartbeatExpired lists up to limit running tasks whose handler has
	// sent no heartbeat for longer than its task's heartbeat timeout plus
	// grace.
	HeartbeatExpired(ctx context.Context, grace time.Duration, limit int) ([]task.Standing, []time.Duration, error)
	// StalePending lists up to limit stale PENDING tasks, oldest due
	// first, leaving out those of the types in skip.
	StalePending(ctx context.Context, after time.Duration, limit int, skip []string) ([]task.Standing, error)
	Apply(ctx context.Context, changes []task.Change) ([]task.Applied, []error, error)
	DeleteExpired(ctx context.Context, retention time.Duration, limit int) (int, error)
	// DeleteExpiredRuns deletes up to limit workflow runs, with their
	// nodes, that ended longer ago than retention and have no task in
	// flight.
	DeleteExpiredRuns(ctx context.Context, retention time.Duration, limit int) (int, error)
	// DeleteExpiredVersions deletes up to limit dataset versions older
	// than retention that are not their dataset's newest and that nothing
	// left refers to.
	DeleteExpiredVersions(ctx context.Context, retention time.Duration, limit int) (int, error)
	// ParkedTypes lists the types of parked messages that a worker heard
	// from within deadAfter consumes; ReleaseParked releases the parked
	// messages of types and drops those of tasks no longer PENDING.
	ParkedTypes(ctx context.Context, deadAfter time.Duration) ([]string, error)
	ReleaseParked(ctx context.Context, types []string) (int, error)
	ReapWorkers(ctx context.Context, deadAfter time.Duration) (int, error)
	CountWorkers(ctx context.Context) (int, error)
}

// Queues tells how many messages wait in a type's queue.
type Queues interface {
	// Ready returns the number of ready messages in the queue of
	// taskType; exists is false when the queue is missing.
	Ready(ctx context.Context, taskType string) (ready int, exists bool, err error)
}

// QueuesFunc adapts a function to Queues.
type QueuesFunc func(ctx context.Context, taskType string) (ready int, exists bool, err error)

// Ready calls f.
func (f QueuesFunc) Ready(ctx context.Context, taskType string) (int, bool, error) {
	return f(ctx, taskType)
}

// MaintenanceConfig tunes the maintenance duties.
type MaintenanceConfig struct {
	WorkerID       string
	Interval       time.Duration
	LeaderTTL      time.Duration
	RepublishAfter time.Duration
	Retention      time.Duration
	DeadAfter      time.Duration
	// BackoffBase and BackoffMax space the attempts of a task whose lease
	// or heartbeat expired, as a failed attempt's are: a task that brings
	// its worker down (a crash, an out-of-memory kill) is not run again at
	// once, on every worker in turn.
	BackoffBase, BackoffMax time.Duration
	// Lease is the workers' lease. A worker stops a handler silent for its
	// task's heartbeat timeout itself, and stores the attempt's outcome
	// within a lease even when the handler ignores its context: the
	// maintenance leader ends only the attempts silent for longer than
	// that, those of a worker that did neither.
	Lease time.Duration
	// BatchSize bounds the rows one statement changes, so a large backlog
	// is worked off in short transactions.
	BatchSize int
}

// Maintainer runs the maintenance duties on whichever worker holds the
// leadership: every worker runs one, one at a time leads.
type Maintainer struct {
	cfg     MaintenanceConfig
	store   MaintenanceStore
	queues  Queues
	log     *slog.Logger
	metrics *Metrics
	leader  bool
	leading atomic.Bool
}

// NewMaintainer returns a maintainer.
func NewMaintainer(cfg MaintenanceConfig, store MaintenanceStore, queues Queues, log *slog.Logger, m *Metrics) *Maintainer {
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 1000
	}
	return &Maintainer{cfg: cfg, store: store, queues: queues, log: log, metrics: m}
}

// Run tries for the leadership every interval and, while it holds it, runs
// the duties. On exit a leader resigns, so another worker takes over at its
// next try rather than after the TTL.
func (m *Maintainer) Run(ctx context.Context) error {
	t := time.NewTicker(m.cfg.Interval)
	defer t.Stop()
	for {
		m.tick(ctx)
		select {
		case <-ctx.Done():
			if m.leader {
				rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
				defer cancel()
				if err := m.store.Resign(rctx, registry.Maintenance, m.cfg.WorkerID); err != nil {
					m.log.WarnContext(ctx, "resign maintenance leadership", "error", err)
				}
			}
			return nil
		case <-t.C:
		}
	}
}

func (m *Maintainer) tick(ctx context.Context) {
	// A hung connection must not hold the duties past the leadership.
	ctx, cancel := context.WithTimeout(ctx, m.cfg.LeaderTTL)
	defer cancel()
	leader, err := m.store.Elect(ctx, registry.Maintenance, m.cfg.WorkerID, m.cfg.LeaderTTL)
	if err != nil {
		if ctx.Err() == nil {
			m.log.WarnContext(ctx, "maintenance election", "error", err)
		}
		leader = false
	}
	if leader != m.leader {
		m.log.InfoContext(ctx, "maintenance leadership changed", "leader", leader)
		m.leader = leader
		m.leading.Store(leader)
		m.metrics.leader.Set(boolGauge(leader))
		if !leader {
			// The count is the leader's: a deposed leader's last one
			// would stand beside the new leader's forever.
			m.metrics.liveWorkers.Set(0)
		}
	}
	if leader {
		m.RunOnce(ctx)
	}
}

// Leading reports whether this worker held the leadership at its last
// election. Safe for concurrent use.
func (m *Maintainer) Leading() bool { return m.leading.Load() }

// RunOnce runs every duty once.
func (m *Maintainer) RunOnce(ctx context.Context) {
	m.repeat(ctx, "reap expired leases", m.reapLeases)
	m.repeat(ctx, "reap silent handlers", m.reapHeartbeats)
	_, err := m.republish(ctx)
	m.failed(ctx, "republish lost messages", err)
	m.count(ctx, "parked_released", func() (int, error) { return m.releaseParked(ctx) })
	m.repeat(ctx, "delete expired tasks", func(ctx context.Context) (int, error) {
		n, err := m.store.DeleteExpired(ctx, m.cfg.Retention, m.cfg.BatchSize)
		m.record(ctx, "deleted_expired", n)
		return n, err
	})
	// Runs after their tasks, and dataset versions after their runs: a
	// version is kept while a node of a run kept refers to it.
	m.repeat(ctx, "delete expired runs", func(ctx context.Context) (int, error) {
		n, err := m.store.DeleteExpiredRuns(ctx, m.cfg.Retention, m.cfg.BatchSize)
		m.record(ctx, "deleted_expired_runs", n)
		return n, err
	})
	m.repeat(ctx, "delete expired dataset versions", func(ctx context.Context) (int, error) {
		n, err := m.store.DeleteExpiredVersions(ctx, m.cfg.Retention, m.cfg.BatchSize)
		m.record(ctx, "deleted_expired_dataset_versions", n)
		return n, err
	})
	m.count(ctx, "dead_workers_removed", func() (int, error) { return m.store.ReapWorkers(ctx, m.cfg.DeadAfter) })
	if n, err := m.store.CountWorkers(ctx); !m.failed(ctx, "count workers", err) {
		m.metrics.liveWorkers.Set(float64(n))
	}
}

// reapLeases ends the attempts whose worker stopped renewing the lease, as
// the lifecycle says (task.OnLeaseExpired), and returns how many it found.
func (m *Maintainer) reapLeases(ctx context.Context) (int, error) {
	expired, err := m.store.ExpiredLeases(ctx, m.cfg.BatchSize)
	if err != nil || len(expired) == 0 {
		return 0, err
	}
	return len(expired), m.apply(ctx, m.endAttempts(expired, func(i int) (string, map[string]any) {
		return "lease expired: worker " + expired[i].WorkerID + " stopped renewing it",
			map[string]any{"reason": "lease expired"}
	}))
}

// reapHeartbeats is the backstop of the workers' own watch of their
// handlers' heartbeats: it ends the attempts whose handler stopped sending
// heartbeats (progress reports) for longer than its task's heartbeat
// timeout and a lease more, as an expired lease would. Their worker, still
// renewing the lease, finds the task moved on at its next write and stops
// the handler.
func (m *Maintainer) reapHeartbeats(ctx context.Context) (int, error) {
	expired, timeouts, err := m.store.HeartbeatExpired(ctx, m.cfg.Lease, m.cfg.BatchSize)
	if err != nil || len(expired) == 0 {
		return 0, err
	}
	return len(expired), m.apply(ctx, m.endAttempts(expired, func(i int) (string, map[string]any) {
		return "heartbeat timed out: no heartbeat from the handler for " + timeouts[i].String(),
			map[string]any{"reason": "heartbeat timed out", "heartbeat_timeout": timeouts[i].String()}
	}))
}

// endAttempts ends running attempts as an expired lease does
// (task.OnLeaseExpired), each with the error and event detail why gives it;
// the detail also names the worker and the attempt. A task queued again is
// due after the backoff its attempt would have had had it failed.
func (m *Maintainer) endAttempts(running []task.Standing, why func(i int) (string, map[string]any)) []task.Change {
	changes := make([]task.Change, len(running))
	for i, e := range running {
		reason, detail := why(i)
		detail["worker_id"], detail["attempt"] = e.WorkerID, e.Attempt
		changes[i] = task.Change{TaskID: e.ID, Version: e.Version,
			Transition: task.OnLeaseExpired(e.CancelPending, e.Attempt, e.MaxAttempts), Error: reason, Detail: detail}
		if changes[i].Transition == task.ExpireRequeue && m.cfg.BackoffBase > 0 {
			changes[i].Delay = retryDelay(e.Attempt, m.cfg.BackoffBase, m.cfg.BackoffMax)
		}
	}
	return changes
}

// republish queues again the PENDING tasks whose message was confirmed long
// ago but never claimed — but only for types whose queue holds no ready
// message. A non-empty queue means the workers are still working through
// it (or none runs): publishing more would only feed the backlog. An empty
// one means those tasks' messages were lost (a purge, a broker that lost
// its queues). It goes through the stale tasks a batch at a time, oldest
// due first, leaving out the types whose queue it found busy: a backlog of
// one type, however long, does not hide the lost tasks of another.
func (m *Maintainer) republish(ctx context.Context) (int, error) {
	empty := map[string]bool{}
	var busy []string
	total := 0
	for {
		stale, err := m.store.StalePending(ctx, m.cfg.RepublishAfter, m.cfg.BatchSize, busy)
		if err != nil || len(stale) == 0 {
			return total, err
		}
		var changes []task.Change
		newlyBusy := false
		for _, s := range stale {
			ok, checked := empty[s.Type]
			if !checked {
				ready, _, err := m.queues.Ready(ctx, s.Type)
				if err != nil {
					return total, err
				}
				ok = ready == 0
				empty[s.Type] = ok
				if !ok {
					busy = append(busy, s.Type)
					newlyBusy = true
					m.log.InfoContext(ctx, "stale tasks wait behind a non-empty queue; not republished", "type", s.Type, "ready", ready)
				}
			}
			if ok {
				changes = append(changes, task.Change{TaskID: s.ID, Version: s.Version, Transition: task.Republish,
					Detail: map[string]any{"reason": "message lost: republished"}})
			}
		}
		if err := m.apply(ctx, changes); err != nil {
			return total, err
		}
		total += len(changes)
		// A batch that is not full held every stale task left. A full one
		// that moved nothing and found no busy type would come back the
		// same: stop.
		if len(stale) < m.cfg.BatchSize || (len(changes) == 0 && !newlyBusy) {
			return total, nil
		}
	}
}

// releaseParked releases the parked messages of the types a live worker
// consumes whose queue exists. A worker registers its types before it
// declares their queues, and one may never manage to (one of its types'
// queues exists with other arguments, its broker URL is wrong): the
// messages of its types would be published and parked again at every
// pass.
func (m *Maintainer) releaseParked(ctx context.Context) (int, error) {
	types, err := m.store.ParkedTypes(ctx, m.cfg.DeadAfter)
	if err != nil {
		return 0, err
	}
	var declared []string
	for _, t := range types {
		_, exists, err := m.queues.Ready(ctx, t)
		if err != nil {
			return 0, err
		}
		if exists {
			declared = append(declared, t)
		}
	}
	return m.store.ReleaseParked(ctx, declared)
}

// apply applies the leader's changes and counts those that landed.
func (m *Maintainer) apply(ctx context.Context, changes []task.Change) error {
	if len(changes) == 0 {
		return nil
	}
	out, errs, err := m.store.Apply(ctx, changes)
	if err != nil {
		return err
	}
	moved := map[task.Transition]int{}
	for i, o := range out {
		if errs[i] != nil {
			m.log.WarnContext(ctx, "maintenance change refused", "task_id", changes[i].TaskID, "transition", changes[i].Transition, "error", errs[i])
			continue
		}
		if !o.Fenced {
			moved[changes[i].Transition]++
		}
	}
	for tr, n := range moved {
		m.record(ctx, string(tr), n)
	}
	return nil
}

// repeat runs a batched duty until a batch is not full.
func (m *Maintainer) repeat(ctx context.Context, duty string, batch func(context.Context) (int, error)) {
	for {
		n, err := batch(ctx)
		if m.failed(ctx, duty, err) || n < m.cfg.BatchSize {
			return
		}
	}
}

// count runs a one-statement duty and records what it changed.
func (m *Maintainer) count(ctx context.Context, action string, duty func() (int, error)) {
	n, err := duty()
	if !m.failed(ctx, action, err) {
		m.record(ctx, action, n)
	}
}

func (m *Maintainer) record(ctx context.Context, action string, n int) {
	if n > 0 {
		m.metrics.maintenance.WithLabelValues(action).Add(float64(n))
		m.log.InfoContext(ctx, "maintenance", "action", action, "count", n)
	}
}

func (m *Maintainer) failed(ctx context.Context, duty string, err error) bool {
	if err == nil {
		return false
	}
	if ctx.Err() == nil {
		m.log.WarnContext(ctx, "maintenance duty failed", "duty", duty, "error", err)
	}
	return true
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
