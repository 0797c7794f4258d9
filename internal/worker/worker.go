// Package worker runs tasks: it consumes the task queues of its handlers,
// claims each task in PostgreSQL, runs its handler under a renewed lease,
// honours cancellation, and stores the outcome with fenced writes. One
// elected worker at a time also runs maintenance.
package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/google/uuid"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/task"
)

// Store is the database as the worker needs it.
type Store interface {
	ClaimMany(ctx context.Context, ids []uuid.UUID, workerID string, lease time.Duration) ([]task.Task, error)
	Progress(ctx context.Context, l *task.Lease, percent int, state string, lease time.Duration) error
	RenewLease(ctx context.Context, l *task.Lease, lease time.Duration) error
	CompleteMany(ctx context.Context, cs []task.Completion) (map[uuid.UUID]int, error)
	Fail(ctx context.Context, l *task.Lease, reason string, permanent bool) error
	ScheduleRetry(ctx context.Context, l *task.Lease, reason string, delay time.Duration, traceparent string, headers task.Carrier) error
	FinishCancelled(ctx context.Context, l *task.Lease) error
	HandBack(ctx context.Context, l *task.Lease, reason string, headers task.Carrier) error
	Inspect(ctx context.Context, id uuid.UUID) (task.Hold, error)
	RegisterWorker(ctx context.Context, w postgres.WorkerInfo) error
	WorkerHeartbeat(ctx context.Context, id string) (bool, error)
	RemoveWorker(ctx context.Context, id string) error
	Ping(ctx context.Context) error
}

// Config tunes a worker.
type Config struct {
	// Info identifies the worker in the registry; Info.ID also marks the
	// tasks it runs.
	Info                postgres.WorkerInfo
	AMQPURL             string
	Concurrency         int
	Lease               time.Duration
	Heartbeat           time.Duration
	ProgressInterval    time.Duration
	BackoffBase         time.Duration
	BackoffMax          time.Duration
	ShutdownTimeout     time.Duration
	ReconnectBackoffMax time.Duration
}

// Worker runs tasks.
type Worker struct {
	cfg        Config
	store      Store
	handlers   map[string]conveyor.HandlerFunc
	log        *slog.Logger
	tracer     trace.Tracer
	propagator propagation.TextMapPropagator
	metrics    *Metrics

	// Claims and completions made at about the same time share a
	// statement and a commit.
	claims    *batcher[uuid.UUID, claimed]
	completes *batcher[task.Completion, int]

	slots    chan struct{}
	inflight sync.WaitGroup
	mu       sync.Mutex
	running  map[uuid.UUID]*execution
	// stopping is closed when the worker stops taking work.
	stopping  chan struct{}
	connected atomic.Bool
}

// New returns a worker for the given handlers. Info.Types is set from them.
func New(cfg Config, store Store, handlers []conveyor.Handler, log *slog.Logger, tp trace.TracerProvider, prop propagation.TextMapPropagator, m *Metrics) (*Worker, error) {
	if len(handlers) == 0 {
		return nil, errors.New("worker: no handlers")
	}
	w := &Worker{
		cfg: cfg, store: store, handlers: map[string]conveyor.HandlerFunc{}, log: log, metrics: m,
		tracer:     tp.Tracer("github.com/conveyorhq/conveyor/internal/worker"),
		propagator: prop,
		slots:      make(chan struct{}, cfg.Concurrency),
		running:    map[uuid.UUID]*execution{},
		stopping:   make(chan struct{}),
	}
	w.claims = newBatcher(cfg.Concurrency, cfg.Lease, w.claimBatch)
	w.completes = newBatcher(cfg.Concurrency, cfg.Lease, w.completeBatch)
	for _, h := range handlers {
		if _, dup := w.handlers[h.Type]; dup {
			return nil, fmt.Errorf("worker: two handlers for type %q", h.Type)
		}
		w.handlers[h.Type] = h.Func
	}
	w.cfg.Info.Types = w.Types()
	return w, nil
}

// Types lists the task types the worker handles, sorted.
func (w *Worker) Types() []string {
	types := make([]string, 0, len(w.handlers))
	for t := range w.handlers {
		types = append(types, t)
	}
	sort.Strings(types)
	return types
}

// Ready reports whether the worker is consuming and its database answers.
func (w *Worker) Ready(ctx context.Context) (bool, error) {
	if !w.connected.Load() {
		return false, nil
	}
	if err := w.store.Ping(ctx); err != nil {
		return false, err
	}
	return true, nil
}

// Run consumes and runs tasks until ctx is done, then shuts down as SPEC 6
// says: it stops taking work, lets running handlers finish within the
// shutdown timeout, then cancels them and hands their tasks back.
func (w *Worker) Run(ctx context.Context) error {
	w.register(ctx)
	// The batchers outlive ctx: running tasks still claim nothing but
	// complete while the worker drains.
	bctx, stopBatchers := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBatchers()
	go w.claims.run(bctx)
	go w.completes.run(bctx)
	// Handlers run under their own context: SIGTERM does not cut them
	// short, the end of the grace period does.
	runCtx, stopHandlers := context.WithCancelCause(context.WithoutCancel(ctx))
	defer stopHandlers(nil)
	go w.heartbeat(ctx)

	consumer := w.consume(ctx, runCtx)
	close(w.stopping)
	w.drain(ctx, consumer, stopHandlers)
	if consumer != nil {
		_ = consumer.Close()
	}
	w.connected.Store(false)
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := w.store.RemoveWorker(rctx, w.cfg.Info.ID); err != nil {
		w.log.WarnContext(ctx, "leave worker registry", "error", err)
	}
	return nil
}

// consume takes deliveries until ctx is done, reconnecting to a lost broker.
// It returns the live consumer, if any, so the shutdown can still hear
// cancel broadcasts while handlers finish.
func (w *Worker) consume(ctx, runCtx context.Context) *rabbitmq.Consumer {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval = 100*time.Millisecond, w.cfg.ReconnectBackoffMax
	for ctx.Err() == nil {
		c, err := rabbitmq.DialConsumer(w.cfg.AMQPURL, "conveyor-worker "+w.cfg.Info.ID, w.Types(), w.cfg.Concurrency)
		if err != nil {
			wait := b.NextBackOff()
			w.log.WarnContext(ctx, "broker unreachable; retrying", "error", err, "retry_in", wait)
			sleep(ctx, wait)
			continue
		}
		b.Reset()
		go w.listenCancels(c)
		w.connected.Store(true)
		w.log.InfoContext(ctx, "consuming", "types", w.Types(), "concurrency", w.cfg.Concurrency)
		if w.serve(ctx, runCtx, c) {
			return c
		}
		w.connected.Store(false)
		w.log.WarnContext(ctx, "broker connection lost; reconnecting", "error", c.Err())
		_ = c.Close()
	}
	return nil
}

// serve dispatches the deliveries of one connection. It returns true when
// ctx ended (the consumer is still open) and false when the connection was
// lost.
func (w *Worker) serve(ctx, runCtx context.Context, c *rabbitmq.Consumer) bool {
	for {
		select {
		case <-ctx.Done():
			c.StopConsuming()
			return true
		case <-c.Closed():
			return false
		case d := <-c.Deliveries():
			select {
			case w.slots <- struct{}{}:
			case <-ctx.Done():
				_ = d.Requeue()
				c.StopConsuming()
				return true
			}
			w.inflight.Add(1)
			go func() {
				defer func() { <-w.slots; w.inflight.Done() }()
				w.process(runCtx, d)
			}()
		}
	}
}

// drain waits for running handlers, giving back messages that still
// arrive, up to the shutdown timeout; then it stops the handlers, whose
// tasks are handed back. Cancel broadcasts are still honoured meanwhile.
func (w *Worker) drain(ctx context.Context, c *rabbitmq.Consumer, stopHandlers context.CancelCauseFunc) {
	done := make(chan struct{})
	go func() { w.inflight.Wait(); close(done) }()
	var deliveries <-chan rabbitmq.Delivery
	if c != nil {
		deliveries = c.Deliveries()
	}
	grace := time.NewTimer(w.cfg.ShutdownTimeout)
	defer grace.Stop()
	w.log.InfoContext(ctx, "stopping: waiting for running tasks", "running", w.runningCount(), "timeout", w.cfg.ShutdownTimeout)
	for {
		select {
		case <-done:
			return
		case d := <-deliveries:
			_ = d.Requeue()
		case <-grace.C:
			w.log.WarnContext(ctx, "shutdown timeout: stopping handlers and handing their tasks back", "running", w.runningCount())
			stopHandlers(conveyor.ErrShutdown)
			select {
			case <-done:
			case <-time.After(w.cfg.Lease):
				w.log.ErrorContext(ctx, "handlers ignored their context; their leases will expire", "running", w.runningCount())
			}
			return
		}
	}
}

// listenCancels passes the cancel broadcasts of a connection to the
// executions they concern, until the connection closes.
func (w *Worker) listenCancels(c *rabbitmq.Consumer) {
	for {
		select {
		case <-c.Closed():
			return
		case id := <-c.Cancels():
			w.cancel(id)
		}
	}
}

// cancel tells the execution of a task, if this worker runs it, that its
// cancellation was requested.
func (w *Worker) cancel(id uuid.UUID) {
	w.mu.Lock()
	e := w.running[id]
	w.mu.Unlock()
	if e != nil {
		e.requestCancel()
	}
}

func (w *Worker) runningCount() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.running)
}

// process claims the task of a delivery and runs it.
func (w *Worker) process(ctx context.Context, d rabbitmq.Delivery) {
	if d.Err != nil {
		w.log.ErrorContext(ctx, "dropping unreadable message", "queue", d.Queue, "message_id", d.MessageID, "error", d.Err)
		w.metrics.dropped.WithLabelValues("unreadable").Inc()
		_ = d.Reject()
		return
	}
	handler := w.handlers[d.Body.Type]
	if handler == nil {
		w.log.ErrorContext(ctx, "no handler for message type; requeued", "type", d.Body.Type, "queue", d.Queue)
		_ = d.Requeue()
		return
	}
	ctx, span := w.startConsumerSpan(ctx, d)
	defer span.End()
	log := w.log.With("task_id", d.Body.TaskID, "type", d.Body.Type)

	t, ok, err := w.claim(ctx, d)
	if err != nil {
		log.WarnContext(ctx, "claim abandoned; message requeued", "error", err)
		_ = d.Requeue()
		return
	}
	// The claim is committed: from here the database, not the broker,
	// holds the task, so the delivery is acked whatever happens next.
	_ = d.Ack()
	if !ok {
		log.DebugContext(ctx, "delivery dropped: task not claimable (terminal, running, or not due)")
		w.metrics.dropped.WithLabelValues("not_claimable").Inc()
		span.AddEvent("dropped: task not claimable")
		return
	}
	e := w.newExecution(t, handler, log.With("attempt", t.Attempt), span)
	w.mu.Lock()
	w.running[t.ID] = e
	w.mu.Unlock()
	defer func() {
		w.mu.Lock()
		delete(w.running, t.ID)
		w.mu.Unlock()
	}()
	e.run(ctx)
}

// claim retries a claim that fails on a database error until it succeeds or
// the worker stops taking work.
func (w *Worker) claim(ctx context.Context, d rabbitmq.Delivery) (task.Task, bool, error) {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval = 100*time.Millisecond, w.cfg.ReconnectBackoffMax
	for {
		c, err := w.claims.do(ctx, d.Body.TaskID)
		if err == nil {
			return c.task, c.ok, nil
		}
		wait := b.NextBackOff()
		w.log.WarnContext(ctx, "claim failed; retrying", "task_id", d.Body.TaskID, "error", err, "retry_in", wait)
		select {
		case <-w.stopping:
			return task.Task{}, false, err
		case <-time.After(wait):
		}
	}
}

type claimed struct {
	task task.Task
	ok   bool
}

// claimBatch claims the tasks of a batch of deliveries in one statement.
// When two deliveries of one task share a batch, only the first gets it.
func (w *Worker) claimBatch(ctx context.Context, ids []uuid.UUID) ([]claimed, []error) {
	res, errs := make([]claimed, len(ids)), make([]error, len(ids))
	tasks, err := w.store.ClaimMany(ctx, ids, w.cfg.Info.ID, w.cfg.Lease)
	if err != nil {
		for i := range errs {
			errs[i] = err
		}
		return res, errs
	}
	byID := make(map[uuid.UUID]task.Task, len(tasks))
	for _, t := range tasks {
		byID[t.ID] = t
	}
	for i, id := range ids {
		if t, ok := byID[id]; ok {
			res[i] = claimed{task: t, ok: true}
			delete(byID, id)
		}
	}
	return res, errs
}

// completeBatch stores a batch of results in one statement; each is fenced
// by its own lease.
func (w *Worker) completeBatch(ctx context.Context, cs []task.Completion) ([]int, []error) {
	res, errs := make([]int, len(cs)), make([]error, len(cs))
	done, err := w.store.CompleteMany(ctx, cs)
	for i, c := range cs {
		v, ok := done[c.Lease.TaskID]
		switch {
		case err != nil:
			errs[i] = err
		case !ok:
			errs[i] = task.ErrFenced
		default:
			res[i] = v
		}
	}
	return res, errs
}

// complete stores a result through the completion batcher.
func (w *Worker) complete(ctx context.Context, l *task.Lease, result []byte) error {
	v, err := w.completes.do(ctx, task.Completion{Lease: *l, Result: result})
	if err != nil {
		return err
	}
	l.Version = v
	return nil
}

// register adds the worker to the registry, retrying until the database
// answers or ctx ends.
func (w *Worker) register(ctx context.Context) {
	b := backoff.NewExponentialBackOff()
	b.MaxInterval = w.cfg.ReconnectBackoffMax
	for ctx.Err() == nil {
		err := w.store.RegisterWorker(ctx, w.cfg.Info)
		if err == nil {
			return
		}
		wait := b.NextBackOff()
		w.log.WarnContext(ctx, "register worker; retrying", "error", err, "retry_in", wait)
		sleep(ctx, wait)
	}
}

// heartbeat keeps the worker's registry row fresh.
func (w *Worker) heartbeat(ctx context.Context) {
	t := time.NewTicker(w.cfg.Heartbeat)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		registered, err := w.store.WorkerHeartbeat(ctx, w.cfg.Info.ID)
		switch {
		case err != nil:
			w.log.WarnContext(ctx, "worker heartbeat", "error", err)
		case !registered:
			w.register(ctx)
		}
	}
}

func sleep(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}
