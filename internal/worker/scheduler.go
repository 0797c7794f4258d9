package worker

import (
	"context"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/job"
)

// SchedulerStore is the database as the scheduler needs it.
type SchedulerStore interface {
	Cron(ctx context.Context, cfg job.CronConfig, now time.Time) (job.CronStats, error)
	Admit(ctx context.Context, cfg job.AdmitConfig) (job.AdmitStats, error)
	CancelStopped(ctx context.Context, limit int) (int, error)
	WakeParents(ctx context.Context, limit int) (int, error)
}

// SchedulerConfig tunes the scheduler.
type SchedulerConfig struct {
	// Interval is the longest time between two passes; a wake-up (a task
	// written, a slot freed) brings the next one forward, but passes are
	// never closer than MinInterval.
	Interval    time.Duration
	MinInterval time.Duration
	// CronEvery spaces the cron passes, which only need to catch the
	// ticks as they come due (a tick's task carries its exact time).
	CronEvery time.Duration
	Cron      job.CronConfig
	Admit     job.AdmitConfig
}

// Scheduler makes the tasks of cron jobs' ticks and admits the tasks that
// wait in PostgreSQL, on the worker that leads maintenance.
type Scheduler struct {
	cfg     SchedulerConfig
	store   SchedulerStore
	leading func() bool
	log     *slog.Logger
	metrics *Metrics
	tracer  trace.Tracer
	wake    chan struct{}
	fair    map[string]bool
	cronAt  time.Time
}

// NewScheduler returns a scheduler that works while leading reports true.
// tp traces its cron passes: the tasks of a pass's ticks carry its trace.
func NewScheduler(cfg SchedulerConfig, store SchedulerStore, leading func() bool, log *slog.Logger, m *Metrics,
	tp trace.TracerProvider) *Scheduler {
	return &Scheduler{cfg: cfg, store: store, leading: leading, log: log, metrics: m,
		tracer: tp.Tracer("github.com/conveyorhq/conveyor/internal/worker"),
		wake:   make(chan struct{}, 1), fair: map[string]bool{}}
}

// Wake asks for a pass soon. It never blocks.
func (s *Scheduler) Wake() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Run runs passes until ctx is done: on a wake-up or after Interval, and
// never closer than MinInterval, so a busy system's many wake-ups are
// served by fewer, larger passes.
func (s *Scheduler) Run(ctx context.Context) error {
	t := time.NewTimer(s.cfg.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		case <-s.wake:
		}
		start := time.Now()
		more := false
		if s.leading() {
			more = s.RunOnce(ctx)
		}
		// A pass that admitted a full batch runs again at once (after the
		// minimum interval); otherwise the next wake-up or the interval.
		took := time.Since(start)
		if rest := s.cfg.MinInterval - took; rest > 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(rest):
			}
		}
		// The interval counts from the pass's start, the minimum's wait
		// included: an idle scheduler passes every Interval, not every
		// MinInterval + Interval. A pass slower than the interval is still
		// followed by a minimum's rest, so that a slow database does not
		// get passes back to back.
		next := max(s.cfg.Interval-time.Since(start), 0)
		if took >= s.cfg.Interval {
			next = s.cfg.MinInterval
		}
		if more {
			next = 0
		}
		if !t.Stop() {
			select {
			case <-t.C:
			default:
			}
		}
		t.Reset(next)
	}
}

// RunOnce makes due ticks (at most every CronEvery) and admits waiting
// tasks once. It reports whether a full batch was admitted (more may be
// admissible at once).
func (s *Scheduler) RunOnce(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, 10*s.cfg.Interval+5*time.Second)
	defer cancel()
	if time.Since(s.cronAt) >= s.cfg.CronEvery {
		s.cronAt = time.Now()
		s.cron(ctx)
	}
	s.sweep(ctx)
	as, err := s.store.Admit(ctx, s.cfg.Admit)
	if err != nil {
		if ctx.Err() == nil {
			s.log.WarnContext(ctx, "admission pass failed", "error", err)
		}
		return false
	}
	if as.Busy {
		// The pass did not look: the types are in the modes they were, and
		// logging them as admitting directly would be news that is false.
		return false
	}
	if as.Admitted > 0 {
		s.metrics.maintenance.WithLabelValues("admitted").Add(float64(as.Admitted))
	}
	fair := map[string]bool{}
	for _, t := range as.Fair {
		fair[t] = true
		if !s.fair[t] {
			s.log.InfoContext(ctx, "type in fair mode: new tasks wait and are admitted in turns between orgs", "type", t)
		}
	}
	for t := range s.fair {
		if !fair[t] {
			s.log.InfoContext(ctx, "type admits directly again", "type", t)
		}
	}
	s.fair = fair
	return as.Admitted >= s.cfg.Admit.MaxAdmit
}

// sweepLimit bounds the tasks one sweep changes.
const sweepLimit = 500

// sweep cancels the tasks still in flight of stopped runs and of parents
// that ended without completing, and wakes the parents whose children all
// finished in a race with their going to wait.
func (s *Scheduler) sweep(ctx context.Context) {
	if n, err := s.store.CancelStopped(ctx, sweepLimit); err != nil {
		if ctx.Err() == nil {
			s.log.WarnContext(ctx, "cancelling the tasks of stopped runs failed", "error", err)
		}
	} else if n > 0 {
		s.metrics.maintenance.WithLabelValues("stopped_run_tasks_cancelled").Add(float64(n))
	}
	if n, err := s.store.WakeParents(ctx, sweepLimit); err != nil {
		if ctx.Err() == nil {
			s.log.WarnContext(ctx, "waking parents failed", "error", err)
		}
	} else if n > 0 {
		s.metrics.maintenance.WithLabelValues("parents_woken").Add(float64(n))
	}
}

// cron makes the tasks of the due ticks, under a span of its own that
// starts their trace: a tick's task is traced from the pass that made it to
// the worker that ran it, as a submitted task is from its request. The span
// starts only once the pass finds something due: a trace for every pass,
// several a second, would bury the tasks' traces.
func (s *Scheduler) cron(ctx context.Context) {
	var span trace.Span
	start := func(ctx context.Context) context.Context {
		if span != nil { // one span a pass, however often asked
			return trace.ContextWithSpan(ctx, span)
		}
		ctx, span = s.tracer.Start(ctx, "cron", trace.WithNewRoot(), trace.WithSpanKind(trace.SpanKindInternal))
		return ctx
	}
	cfg := s.cfg.Cron
	cfg.Trace = start
	cs, err := s.store.Cron(ctx, cfg, time.Now())
	if span == nil && err != nil {
		// A failed pass is an error in a trace of its own, whether or
		// not it got as far as finding its ticks.
		start(ctx)
	}
	if span != nil {
		ctx = trace.ContextWithSpan(ctx, span)
		span.SetAttributes(attribute.Int("conveyor.tasks_made", cs.Made))
		defer span.End()
	}
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
		if ctx.Err() == nil {
			s.log.WarnContext(ctx, "cron pass failed", "error", err)
		}
		return
	}
	for id, err := range cs.Errors {
		s.log.WarnContext(ctx, "job schedule does not parse; skipped", "job_id", id, "error", err)
	}
	if cs.Made > 0 {
		s.metrics.maintenance.WithLabelValues("cron_tasks_made").Add(float64(cs.Made))
	}
	if cs.Skipped > 0 {
		s.metrics.maintenance.WithLabelValues("cron_ticks_skipped").Add(float64(cs.Skipped))
		s.log.InfoContext(ctx, "missed cron ticks skipped", "ticks", cs.Skipped)
	}
}
