package worker

import (
	"context"
	"log/slog"
	"time"

	"github.com/conveyorhq/conveyor/internal/task"
)

// MaintenanceStore is the database as the maintenance leader needs it.
type MaintenanceStore interface {
	Elect(ctx context.Context, name, id string, ttl time.Duration) (bool, error)
	Resign(ctx context.Context, name, id string) error
	ReapLeases(ctx context.Context, limit int) (map[task.Status]int, error)
	RepublishStale(ctx context.Context, after time.Duration, limit int) (int, error)
	DeleteExpired(ctx context.Context, retention time.Duration, limit int) (int, error)
	ReapWorkers(ctx context.Context, deadAfter time.Duration) (int, error)
	CountWorkers(ctx context.Context) (int, error)
}

// MaintenanceConfig tunes the maintenance duties.
type MaintenanceConfig struct {
	WorkerID       string
	Interval       time.Duration
	LeaderTTL      time.Duration
	RepublishAfter time.Duration
	Retention      time.Duration
	DeadAfter      time.Duration
	// BatchSize bounds the rows one statement changes, so a large backlog
	// is worked off in short transactions.
	BatchSize int
}

// leadership is the name of the maintenance duty in the leaders table.
const leadership = "maintenance"

// Maintainer runs the maintenance duties on whichever worker holds the
// leadership: every worker runs one, one at a time leads.
type Maintainer struct {
	cfg     MaintenanceConfig
	store   MaintenanceStore
	log     *slog.Logger
	metrics *Metrics
	leader  bool
}

// NewMaintainer returns a maintainer.
func NewMaintainer(cfg MaintenanceConfig, store MaintenanceStore, log *slog.Logger, m *Metrics) *Maintainer {
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 1000
	}
	return &Maintainer{cfg: cfg, store: store, log: log, metrics: m}
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
				if err := m.store.Resign(rctx, leadership, m.cfg.WorkerID); err != nil {
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
	leader, err := m.store.Elect(ctx, leadership, m.cfg.WorkerID, m.cfg.LeaderTTL)
	if err != nil {
		if ctx.Err() == nil {
			m.log.WarnContext(ctx, "maintenance election", "error", err)
		}
		leader = false
	}
	if leader != m.leader {
		m.log.InfoContext(ctx, "maintenance leadership changed", "leader", leader)
		m.leader = leader
		m.metrics.leader.Set(boolGauge(leader))
	}
	if leader {
		m.RunOnce(ctx)
	}
}

// RunOnce runs every duty once.
func (m *Maintainer) RunOnce(ctx context.Context) {
	for {
		reaped, err := m.store.ReapLeases(ctx, m.cfg.BatchSize)
		if m.failed(ctx, "reap expired leases", err) {
			break
		}
		n := 0
		for status, c := range reaped {
			n += c
			m.metrics.maintenance.WithLabelValues("lease_expired_to_" + string(status)).Add(float64(c))
		}
		if n > 0 {
			m.log.InfoContext(ctx, "expired leases reaped", "tasks", reaped)
		}
		if n < m.cfg.BatchSize {
			break
		}
	}
	m.repeat(ctx, "republished", func() (int, error) {
		return m.store.RepublishStale(ctx, m.cfg.RepublishAfter, m.cfg.BatchSize)
	})
	m.repeat(ctx, "deleted_expired", func() (int, error) {
		return m.store.DeleteExpired(ctx, m.cfg.Retention, m.cfg.BatchSize)
	})
	if n, err := m.store.ReapWorkers(ctx, m.cfg.DeadAfter); !m.failed(ctx, "remove dead workers", err) && n > 0 {
		m.metrics.maintenance.WithLabelValues("dead_workers_removed").Add(float64(n))
		m.log.InfoContext(ctx, "dead workers removed", "workers", n)
	}
	if n, err := m.store.CountWorkers(ctx); !m.failed(ctx, "count workers", err) {
		m.metrics.liveWorkers.Set(float64(n))
	}
}

// repeat runs a batched duty until a batch is not full.
func (m *Maintainer) repeat(ctx context.Context, action string, batch func() (int, error)) {
	for {
		n, err := batch()
		if m.failed(ctx, action, err) {
			return
		}
		if n > 0 {
			m.metrics.maintenance.WithLabelValues(action).Add(float64(n))
			m.log.InfoContext(ctx, "maintenance", "action", action, "tasks", n)
		}
		if n < m.cfg.BatchSize {
			return
		}
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
