package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"runtime/debug"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/cenkalti/backoff/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/task"
)

// maxStateLen bounds the state label a handler reports, in bytes.
const maxStateLen = 200

// execution is one attempt of one task on this worker. Its run loop is the
// only writer of the task while it runs, so the lease's version moves in one
// place.
type execution struct {
	w       *Worker
	task    task.Task
	lease   task.Lease
	handler conveyor.HandlerFunc
	log     *slog.Logger
	span    trace.Span
	started time.Time

	// stop cancels the handler's context with a cause.
	stop   context.CancelCauseFunc
	hctx   context.Context
	cancel chan struct{} // a cancel broadcast arrived
	report chan struct{} // a progress report is waiting

	mu     sync.Mutex
	latest *progress

	// cancelled: cancellation was requested and the task is still ours;
	// lost: the task is no longer ours and nothing more may be written.
	cancelled   bool
	cancelledAt time.Time
	lost        bool
}

type progress struct {
	percent int
	state   string
}

type outcome struct {
	result any
	err    error
}

func (w *Worker) newExecution(t task.Task, h conveyor.HandlerFunc, log *slog.Logger, span trace.Span) *execution {
	return &execution{
		w: w, task: t, handler: h, log: log, span: span, started: time.Now(),
		lease:  task.Lease{TaskID: t.ID, WorkerID: w.cfg.Info.ID, Attempt: t.Attempt, Version: t.Version},
		cancel: make(chan struct{}, 1),
		report: make(chan struct{}, 1),
	}
}

// requestCancel is called when a cancel broadcast names this task.
func (e *execution) requestCancel() {
	select {
	case e.cancel <- struct{}{}:
	default:
	}
}

// Progress implements conveyor.Reporter: it keeps the latest report for the
// run loop, which stores it at most once per ProgressInterval.
func (e *execution) Progress(_ context.Context, percent int, state string) error {
	if percent < 0 || percent > 100 {
		return fmt.Errorf("progress %d out of range 0..100", percent)
	}
	if e.hctx.Err() != nil {
		return context.Cause(e.hctx)
	}
	if len(state) > maxStateLen {
		state = state[:maxStateLen]
		for !utf8.ValidString(state) {
			state = state[:len(state)-1]
		}
	}
	e.mu.Lock()
	e.latest = &progress{percent: percent, state: state}
	e.mu.Unlock()
	e.span.AddEvent("progress", trace.WithAttributes(
		attribute.Int("conveyor.progress", percent), attribute.String("conveyor.state", state)))
	select {
	case e.report <- struct{}{}:
	default:
	}
	return nil
}

// run calls the handler and, meanwhile, renews the lease, stores progress
// and listens for cancellation; then it stores the outcome.
func (e *execution) run(ctx context.Context) {
	e.w.metrics.started.WithLabelValues(e.task.Type).Inc()
	e.w.metrics.running.Inc()
	defer e.w.metrics.running.Dec()
	if e.task.StartedAt != nil && e.task.StartedAt.After(e.task.NextRunAt) {
		e.w.metrics.queueWait.WithLabelValues(e.task.Type).Observe(e.task.StartedAt.Sub(e.task.NextRunAt).Seconds())
	}
	e.log.InfoContext(ctx, "task started")

	e.hctx, e.stop = context.WithCancelCause(ctx)
	defer e.stop(nil)
	// The handler stops when ctx ends (shutdown grace over); the writes
	// that follow, such as handing the task back, must not.
	ctx = context.WithoutCancel(ctx)
	done := make(chan outcome, 1)
	go func() { done <- e.call() }()

	heartbeat := time.NewTicker(e.w.cfg.Heartbeat)
	defer heartbeat.Stop()
	var lastWrite time.Time
	var timer *time.Timer
	var timerC <-chan time.Time
	for {
		select {
		case out := <-done:
			if timer != nil {
				timer.Stop()
			}
			e.finish(ctx, out)
			return
		case <-heartbeat.C:
			if !e.lost {
				e.check(ctx, e.bounded(ctx, func(ctx context.Context) error { return e.w.store.RenewLease(ctx, &e.lease, e.w.cfg.Lease) }))
			}
		case <-e.cancel:
			e.markCancelled(ctx)
		case <-e.report:
			if wait := e.w.cfg.ProgressInterval - time.Since(lastWrite); wait > 0 {
				if timerC == nil {
					timer = time.NewTimer(wait)
					timerC = timer.C
				}
				continue
			}
			e.flushProgress(ctx)
			lastWrite = time.Now()
		case <-timerC:
			timerC = nil
			e.flushProgress(ctx)
			lastWrite = time.Now()
		}
	}
}

// call runs the handler, turning a panic into an error.
func (e *execution) call() (out outcome) {
	defer func() {
		if v := recover(); v != nil {
			out = outcome{err: &conveyor.PanicError{Value: v, Stack: debug.Stack()}}
		}
	}()
	result, err := e.handler(e.hctx, conveyor.Task{
		ID: e.task.ID, Type: e.task.Type, Payload: e.task.Payload, Metadata: e.task.Metadata,
		Attempt: e.task.Attempt, MaxAttempts: e.task.MaxAttempts,
	}, e)
	return outcome{result: result, err: err}
}

// flushProgress stores the latest report, if any.
func (e *execution) flushProgress(ctx context.Context) {
	e.mu.Lock()
	p := e.latest
	e.latest = nil
	e.mu.Unlock()
	if p == nil || e.lost || e.cancelled {
		return
	}
	err := e.bounded(ctx, func(ctx context.Context) error {
		return e.w.store.Progress(ctx, &e.lease, p.percent, p.state, e.w.cfg.Lease)
	})
	if err != nil && !errors.Is(err, task.ErrFenced) {
		// Keep it for the next try unless a newer report replaced it.
		e.mu.Lock()
		if e.latest == nil {
			e.latest = p
		}
		e.mu.Unlock()
	}
	e.check(ctx, err)
}

// check handles the error of a write made while the handler runs. A fenced
// write that missed means the version moved: either a cancel was requested
// (the task is still ours, at a new version) or the task was lost. Either
// way the handler is stopped.
func (e *execution) check(ctx context.Context, err error) {
	switch {
	case err == nil:
	case errors.Is(err, task.ErrFenced):
		if _, err := e.reclaim(ctx); err != nil {
			e.log.WarnContext(ctx, "read task after fenced write; will retry", "error", err)
		}
	default:
		// The database is unreachable: keep running and try again at the
		// next heartbeat; the lease covers the gap.
		e.log.WarnContext(ctx, "task write failed; will retry", "error", err)
	}
}

// reclaim reads the task after a fenced write missed. If it is still ours
// because a cancel was requested, it adopts the new version, stops the
// handler and reports owned; otherwise the task is lost and the handler
// stopped. err is a failed read: nothing is decided.
func (e *execution) reclaim(ctx context.Context) (owned bool, err error) {
	var hold task.Hold
	err = e.bounded(ctx, func(ctx context.Context) (err error) {
		hold, err = e.w.store.Inspect(ctx, e.lease.TaskID)
		return err
	})
	if err != nil && !errors.Is(err, task.ErrNotFound) {
		return false, err
	}
	if err == nil && hold.Owns(e.lease) && hold.CancelRequested {
		e.lease.Version = hold.Version
		e.markCancelled(ctx)
		return true, nil
	}
	if !e.lost {
		e.lost = true
		e.log.WarnContext(ctx, "task lost: another writer moved it on", "status", hold.Status, "holder", hold.WorkerID)
		e.span.AddEvent("task lost")
		e.stop(conveyor.ErrLost)
	}
	return false, nil
}

func (e *execution) markCancelled(ctx context.Context) {
	if e.cancelled || e.lost {
		return
	}
	e.cancelled, e.cancelledAt = true, time.Now()
	e.log.InfoContext(ctx, "cancel requested: stopping handler")
	e.span.AddEvent("cancel requested")
	e.stop(conveyor.ErrCancelled)
}

// finish stores the attempt's outcome.
func (e *execution) finish(ctx context.Context, out outcome) {
	cause := context.Cause(e.hctx)
	if e.hctx.Err() == nil {
		// The handler returned on its own: its last progress report lands
		// before the outcome.
		e.flushProgress(ctx)
	}
	if e.lost {
		e.done(ctx, "lost", nil)
		return
	}
	switch {
	case e.cancelled || errors.Is(cause, conveyor.ErrCancelled):
		e.store(ctx, "cancelled", func(ctx context.Context) error { return e.w.store.FinishCancelled(ctx, &e.lease) })
		e.w.metrics.cancelLatency.Observe(time.Since(e.cancelledAt).Seconds())
	case errors.Is(cause, conveyor.ErrShutdown):
		headers := e.w.inject(ctx)
		e.store(ctx, "handed_back", func(ctx context.Context) error {
			return e.w.store.HandBack(ctx, &e.lease, "worker shutting down", headers)
		})
	case out.err == nil:
		result, err := json.Marshal(out.result)
		if err != nil {
			e.fail(ctx, conveyor.Permanent(fmt.Errorf("result is not JSON: %w", err)))
			return
		}
		e.store(ctx, "completed", func(ctx context.Context) error { return e.w.complete(ctx, &e.lease, result) })
	default:
		e.fail(ctx, out.err)
	}
}

// fail ends the attempt in error: FAILED when the error is permanent or no
// attempts are left, otherwise PENDING again after a backoff.
func (e *execution) fail(ctx context.Context, err error) {
	reason := err.Error()
	var p *conveyor.PanicError
	if errors.As(err, &p) {
		e.log.ErrorContext(ctx, "handler panicked", "panic", fmt.Sprint(p.Value), "stack", string(p.Stack))
	}
	e.span.RecordError(err)
	permanent := conveyor.IsPermanent(err)
	if permanent || e.task.Attempt >= e.task.MaxAttempts {
		e.store(ctx, "failed", func(ctx context.Context) error { return e.w.store.Fail(ctx, &e.lease, reason, permanent) })
		return
	}
	delay := retryDelay(e.task.Attempt, e.w.cfg.BackoffBase, e.w.cfg.BackoffMax)
	traceparent, headers := e.w.retryTrace(ctx, e.task)
	e.log.InfoContext(ctx, "attempt failed; retry scheduled", "error", reason, "retry_in", delay)
	e.store(ctx, "retried", func(ctx context.Context) error {
		return e.w.store.ScheduleRetry(ctx, &e.lease, reason, delay, traceparent, headers)
	})
}

// store makes the outcome's write. If its fence misses because a cancel was
// requested meanwhile, the task ends CANCELLED instead: a task whose
// cancellation was accepted never completes nor runs again. A database that
// does not answer is retried for as long as the lease lasts; after that the
// lease's expiry hands the task on.
func (e *execution) store(ctx context.Context, outcome string, write func(context.Context) error) {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval = 100*time.Millisecond, e.w.cfg.ReconnectBackoffMax
	deadline := time.Now().Add(e.w.cfg.Lease)
	for {
		err := e.bounded(ctx, write)
		switch {
		case err == nil:
			e.done(ctx, outcome, nil)
			return
		case errors.Is(err, task.ErrFenced):
			owned, rerr := e.reclaim(ctx)
			if rerr == nil && !owned {
				e.done(ctx, "lost", err)
				return
			}
			if rerr == nil {
				outcome = "cancelled"
				write = func(ctx context.Context) error { return e.w.store.FinishCancelled(ctx, &e.lease) }
				continue
			}
			err = rerr
		}
		if time.Now().After(deadline) {
			e.done(ctx, "abandoned", err)
			return
		}
		wait := b.NextBackOff()
		e.log.WarnContext(ctx, "storing outcome failed; retrying", "outcome", outcome, "error", err, "retry_in", wait)
		time.Sleep(wait)
	}
}

// done logs and counts the end of the attempt.
func (e *execution) done(ctx context.Context, outcome string, err error) {
	e.w.metrics.finished.WithLabelValues(e.task.Type, outcome).Inc()
	e.w.metrics.duration.WithLabelValues(e.task.Type, outcome).Observe(time.Since(e.started).Seconds())
	e.span.SetAttributes(attribute.String("conveyor.outcome", outcome))
	if err != nil {
		e.span.SetStatus(codes.Error, err.Error())
		e.log.WarnContext(ctx, "task attempt ended", "outcome", outcome, "error", err)
		return
	}
	if outcome == "failed" {
		e.span.SetStatus(codes.Error, "task failed")
	}
	e.log.InfoContext(ctx, "task attempt ended", "outcome", outcome, "duration", time.Since(e.started))
}

// bounded runs a database call under a deadline of one lease: a connection
// that hangs (a half-open link) must not freeze the task's run loop, whose
// lease would expire anyway.
func (e *execution) bounded(ctx context.Context, call func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, e.w.cfg.Lease)
	defer cancel()
	return call(ctx)
}

// retryDelay is the wait before attempt+1: base doubled per attempt, capped,
// with "equal jitter" (between half and all of it) so that tasks failing
// together do not retry together.
func retryDelay(attempt int, base, limit time.Duration) time.Duration {
	d := base
	for i := 1; i < attempt && d < limit; i++ {
		d *= 2
	}
	d = min(d, limit)
	half := d / 2
	return half + rand.N(d-half+1)
}
