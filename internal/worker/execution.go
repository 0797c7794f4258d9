package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"regexp"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/wait"
)

// execution is one attempt of one task on this worker. Its run loop is the
// only writer of the task while it runs, so the lease's version moves in one
// place.
type execution struct {
	w    *Worker
	task task.Task
	// awaiting says Gather reported children still running: only then
	// does the task wait for them (they wake it when they end).
	awaiting atomic.Bool
	// returned says the handler has returned (or exited): its Reporter,
	// kept by a goroutine of its, records nothing more.
	returned atomic.Bool
	lease    task.Lease
	handler  conveyor.HandlerFunc
	log      taskLog
	span     trace.Span
	delivery outbox.Delivery
	// release frees the delivery's place in the worker's window once the
	// handler has returned; slotted says the handler took a slot.
	release func()
	slotted bool
	// start decides, once, between the handler starting and a task
	// claimed ahead giving up its wait for a slot.
	start   atomic.Int32
	started time.Time
	// claimVersion is the version the claim left: a cancel broadcast that
	// names an earlier version was for an earlier run.
	claimVersion int

	// stop cancels the handler's context with a cause.
	stop   context.CancelCauseFunc
	hctx   context.Context
	cancel chan int      // a cancel broadcast arrived, with its version
	report chan struct{} // a progress report is waiting

	mu     sync.Mutex
	latest *progress
	// reported is when the handler last reported progress, a heartbeat
	// (under mu): the run loop, held up by a slow write, may take a
	// report only after the silence it ends has come due.
	reported time.Time
	// renewed is when the last write that renewed the lease and landed
	// was sent (at first, the claim): the lease in the database runs from
	// no earlier, so a lease past it on this worker's clock may have
	// expired there (under mu). leaseTimer watches it (under mu); fence
	// says whether the handler was stopped for it (fenceExpired) before
	// its attempt ended (fenceClosed), and expired is closed when it was.
	renewed    time.Time
	leaseTimer *time.Timer
	fence      atomic.Int32
	expired    chan struct{}

	// cancelled: cancellation was requested and the task is still ours;
	// lost: the task is no longer ours and nothing more may be written;
	// timedOut: the attempt ran past the maximum run time; silent: its
	// handler sent no heartbeat for the task's heartbeat timeout.
	cancelled   bool
	cancelledAt time.Time
	lost        bool
	timedOut    bool
	silent      bool
	acked       bool
	// orphan: the source this task's delivery came through is gone (under
	// w.mu).
	orphan bool
}

type progress struct {
	percent int
	state   string
}

type outcome struct {
	result any
	err    error
	// cause is the cause of the handler's context when the handler
	// returned (nil: it was not cancelled): the shutdown's grace may end
	// after that, before the run loop takes the outcome.
	cause error
	// encoded is the result as JSON, or why it cannot be (encodeErr):
	// encoded where the handler ran, so that a panic of its encoding is
	// the handler's, recovered.
	encoded   json.RawMessage
	encodeErr error
}

// newExecution returns the attempt of t, claimed by a claim sent at
// claimed.
func (w *Worker) newExecution(t task.Task, h conveyor.HandlerFunc, log taskLog, span trace.Span, d outbox.Delivery,
	claimed time.Time) *execution {
	return &execution{
		w: w, task: t, handler: h, log: log, span: span, delivery: d, started: time.Now(),
		lease:        task.Lease{TaskID: t.ID, WorkerID: w.cfg.Info.ID, Attempt: t.Attempt, Version: t.Version},
		claimVersion: t.Version,
		cancel:       make(chan int, 1),
		report:       make(chan struct{}, 1),
		renewed:      claimed,
		expired:      make(chan struct{}),
	}
}

// The values of execution.fence.
const (
	fenceOpen int32 = iota
	fenceClosed
	fenceExpired
)

// watchLease stops the handler as lost (ErrLost) once a lease has passed
// since the last renewal that landed, unless its attempt ended first: the
// lease reaper may then have queued the task again, for another worker to
// run beside this one. A worker cut off from the database learns nothing
// from its writes, which fail; its own clock is what it has left. The
// timer runs beside the run loop, which may wait a lease on a write.
func (e *execution) watchLease() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.leaseTimer = time.AfterFunc(e.w.cfg.Lease-time.Since(e.renewed), e.checkLease)
}

func (e *execution) checkLease() {
	if e.fence.Load() != fenceOpen {
		return
	}
	e.mu.Lock()
	if left := e.w.cfg.Lease - time.Since(e.renewed); left > 0 {
		e.leaseTimer.Reset(left)
		e.mu.Unlock()
		return
	}
	e.mu.Unlock()
	if e.fence.CompareAndSwap(fenceOpen, fenceExpired) {
		e.stop(conveyor.ErrLost)
		close(e.expired)
	}
}

// stopWatchingLease ends the lease's watch.
func (e *execution) stopWatchingLease() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.leaseTimer != nil {
		e.leaseTimer.Stop()
	}
}

// closeFence ends the lease's watch for an attempt that ended (its handler
// returned, or the attempt ends without it), unless it was stopped as lost
// first.
func (e *execution) closeFence() {
	e.fence.CompareAndSwap(fenceOpen, fenceClosed)
}

// noteExpired makes a handler stopped for its lease lost: nothing more is
// written for it, neither renewal nor outcome (the task is the reaper's
// to end, and any write would only delay it).
func (e *execution) noteExpired(ctx context.Context) {
	if e.lost || e.fence.Load() != fenceExpired {
		return
	}
	e.lost = true
	e.log.WarnContext(ctx, "task lost: no lease renewal landed for a lease; handler stopped", "lease", e.w.cfg.Lease)
	e.span.AddEvent("task lost: lease not renewed")
}

// handBackUnrun hands back a claimed task without running a handler.
func (e *execution) handBackUnrun(ctx context.Context, reason string) {
	e.hctx, e.stop = context.WithCancelCause(ctx)
	defer e.stop(nil)
	e.fence.Store(fenceClosed)
	e.store(context.WithoutCancel(ctx), "handed_back", task.Change{Transition: task.HandBack, Trace: e.w.inject(ctx),
		Detail: map[string]any{"handed_back": reason, "attempt": e.task.Attempt}})
	e.ack()
}

// requestCancel is called when a cancel broadcast names this task. Only the
// newest version waiting matters: a broadcast of an earlier run, still
// waiting for the run loop, must not crowd out this run's, which would
// then stop the handler only at the next lease renewal.
func (e *execution) requestCancel(version int) {
	for {
		select {
		case e.cancel <- version:
			return
		default:
		}
		select {
		case waiting := <-e.cancel:
			version = max(version, waiting)
		default:
		}
	}
}

// Progress implements conveyor.Reporter: it keeps the latest report for the
// run loop, which stores it at most once per ProgressInterval.
func (e *execution) Progress(_ context.Context, percent int, state string) error {
	if percent < 0 || percent > 100 {
		return fmt.Errorf("progress %d out of range 0..100", percent)
	}
	if err := e.usable(); err != nil {
		return err
	}
	state = task.CleanText(state, task.MaxStateLen)
	e.mu.Lock()
	if e.returned.Load() {
		// The handler returned meanwhile (a goroutine of its reports):
		// the outcome's last flush may have run already, and a report
		// kept now would be accepted and never stored. Checked under mu,
		// which that flush takes after the handler returned.
		e.mu.Unlock()
		return errReporterDone
	}
	stored := percent
	if e.latest != nil {
		// Progress never goes backwards within an attempt: a higher
		// report still waiting for its turn is not lost behind a lower
		// one (the store keeps the higher of what it has and what it gets).
		stored = max(stored, e.latest.percent)
	}
	e.latest = &progress{percent: stored, state: state}
	e.reported = time.Now()
	e.mu.Unlock()
	e.span.AddEvent("progress", trace.WithAttributes(
		attribute.Int("conveyor.progress", percent), attribute.String("conveyor.state", state)))
	select {
	case e.report <- struct{}{}:
	default:
	}
	return nil
}

// lastReport is when the handler last reported progress (zero: never).
func (e *execution) lastReport() time.Time {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.reported
}

// errReporterDone refuses a Reporter used after its handler returned.
var errReporterDone = errors.New("conveyor: the handler has returned: its Reporter records nothing more")

// usable says why the handler's Reporter may record nothing more, if it
// may not: the handler's context ended, or the handler returned (its
// outcome is being stored, and a report or a child would land after it).
func (e *execution) usable() error {
	if e.returned.Load() {
		return errReporterDone
	}
	if e.hctx.Err() != nil {
		return context.Cause(e.hctx)
	}
	return nil
}

// run calls the handler and, meanwhile, renews the lease, stores progress,
// listens for cancellation and watches the run time; then it stores the
// outcome and settles the delivery (a packed task's was settled at its
// claim).
func (e *execution) run(ctx context.Context) {
	e.w.metrics.started.WithLabelValues(e.task.Type).Inc()
	if e.task.StartedAt != nil && e.task.StartedAt.After(e.task.NextRunAt) {
		e.w.metrics.queueWait.WithLabelValues(e.task.Type).Observe(e.task.StartedAt.Sub(e.task.NextRunAt).Seconds())
	}
	e.log.DebugContext(ctx, "task started")
	e.w.signals.started.send(e.task.ID)

	e.hctx, e.stop = context.WithCancelCause(ctx)
	defer e.stop(nil)
	// The handler stops when ctx ends (shutdown grace over); the writes
	// that follow, such as handing the task back, must not.
	ctx = context.WithoutCancel(ctx)
	done, started := make(chan outcome, 1), make(chan struct{})
	e.watchLease()
	defer e.stopWatchingLease()
	go func() {
		if !e.takeSlot() {
			e.closeFence()
			done <- outcome{err: context.Cause(e.hctx), cause: context.Cause(e.hctx)}
			return
		}
		close(started)
		e.w.metrics.running.Inc()
		returned := false
		defer func() {
			e.w.metrics.running.Dec()
			if !returned {
				// The handler ended its goroutine (runtime.Goexit, as
				// testing's FailNow does) instead of returning.
				e.closeFence()
				done <- outcome{err: errHandlerExited, cause: context.Cause(e.hctx)}
			}
		}()
		out := e.call()
		// A handler that returned before its lease ran out has its
		// outcome written, however long the database takes to answer
		// (store): the write is fenced.
		e.closeFence()
		out.cause = context.Cause(e.hctx)
		returned = true
		done <- out
	}()
	defer e.ack()

	// One timer keeps the attempt's four clocks: the next heartbeat,
	// which renews the lease; the long mark, which until the handler
	// starts bounds its wait for a slot and from then on marks it as
	// running long; the run time, which starts with the handler; and the
	// handler's silence, which starts with the handler too and starts
	// again with each progress report (neither counts a wait for a slot).
	// A zero time is a clock not running.
	now := time.Now()
	c := clocks{beat: now.Add(e.w.cfg.Heartbeat), long: now.Add(e.w.cfg.LongAfter), every: e.w.cfg.Heartbeat}
	clock := time.NewTimer(time.Until(c.next()))
	defer clock.Stop()
	isLong := false
	defer func() {
		if isLong {
			e.w.long.Add(-1)
			e.w.pokeCredit()
		}
	}()
	var giveUp <-chan time.Time // once stopped (timed out, cancelled), how long the handler may take to stop
	abandon := e.w.abandon
	var lastWrite time.Time
	var timer *time.Timer
	var timerC <-chan time.Time
	expired := e.expired
	for {
		if e.cancelled && giveUp == nil {
			// A cancelled handler gets one lease to stop, as a timed-out
			// one does: the cancel must not wait for its run time.
			giveUp = time.After(e.w.cfg.Lease)
		}
		select {
		case <-started:
			started = nil
			now := time.Now()
			c.long, c.deadline = now.Add(e.w.cfg.LongAfter), now.Add(e.runTime())
			if hb := e.task.HeartbeatTimeout; hb > 0 {
				c.silent = now.Add(hb)
			}
			clock.Reset(time.Until(c.next()))
		case out := <-done:
			e.free()
			if isLong {
				// The slot is free: the credit need not wait for the
				// outcome's write.
				isLong = false
				e.w.long.Add(-1)
				e.w.pokeCredit()
			}
			if timer != nil {
				timer.Stop()
			}
			e.finish(ctx, out)
			return
		case <-expired:
			expired = nil
			e.noteExpired(ctx)
		case v := <-e.cancel:
			if v > e.claimVersion {
				e.markCancelled(ctx)
			} else {
				e.log.DebugContext(ctx, "ignoring a cancel broadcast of an earlier run", "version", v)
			}
		case <-e.report:
			if hb := e.task.HeartbeatTimeout; hb > 0 && !c.silent.IsZero() {
				// A heartbeat: the silence starts again. The timer, set
				// for the earlier silence, finds it not due and is set
				// again.
				c.silent = time.Now().Add(hb)
			}
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
		case now := <-clock.C:
			e.noteExpired(ctx)
			beat, long, deadline, silent := c.take(now)
			switch {
			case beat && !e.lost && timerC == nil && e.reportWaiting():
				// A report whose write failed is stored now, renewing
				// the lease as well: with no newer report to carry it,
				// it would wait for the outcome.
				e.flushProgress(ctx)
				lastWrite = time.Now()
			case beat && !e.lost:
				// A renewal is bookkeeping, not the task's work: traced,
				// each heartbeat would add a database span to the task's
				// trace for as long as it runs.
				e.check(ctx, e.write(untraced(ctx), task.Change{Transition: task.Renew}))
			}
			switch {
			case long && started != nil:
				// Claimed ahead, and every slot stayed taken: another
				// worker may start it sooner, unless the handler is
				// starting right now (its start sets this clock again).
				if e.start.CompareAndSwap(startWaiting, startGivenUp) {
					e.stop(errNoSlot)
				}
			case long:
				// From now on the broker sends this worker nothing it
				// could not start at once (Worker.prefetch).
				isLong = true
				e.w.long.Add(1)
				e.w.pokeCredit()
			}
			// A handler whose outcome already waits in done returned
			// within its run time, though the loop sees the clock first
			// (it was busy writing when both came due): it did not time
			// out, and its outcome is taken at the next turn.
			if deadline && len(done) == 0 {
				if !e.cancelled && !e.lost && !e.silent {
					e.timedOut = true
					e.log.WarnContext(ctx, "attempt ran past its run time: stopping the handler", "run_time", e.runTime())
					e.span.AddEvent("timed out")
					e.stop(conveyor.ErrTimeout)
				}
				if giveUp == nil {
					giveUp = time.After(e.w.cfg.Lease)
				}
			}
			// A handler silent for its heartbeat timeout is stopped here,
			// as one past its run time is, and its attempt fails once it
			// has returned: the task holds its slot, and runs nowhere
			// else, until then. Ended by the maintenance leader instead,
			// the handler would run on until this worker's next lease
			// renewal found the task lost, beside the task's next
			// attempt on another worker.
			if silent {
				// A report the loop has not taken yet, made within the
				// timeout, is a heartbeat all the same.
				if until := e.lastReport().Add(e.task.HeartbeatTimeout); until.After(time.Now()) {
					silent, c.silent = false, until
				}
			}
			if silent && len(done) == 0 {
				if !e.cancelled && !e.lost && !e.timedOut {
					e.silent = true
					e.log.WarnContext(ctx, "handler sent no heartbeat for its heartbeat timeout: stopping it",
						"heartbeat_timeout", e.task.HeartbeatTimeout)
					e.span.AddEvent("heartbeat timed out")
					e.stop(conveyor.ErrTimeout)
				}
				if giveUp == nil {
					giveUp = time.After(e.w.cfg.Lease)
				}
			}
			clock.Reset(time.Until(c.next()))
		case <-giveUp:
			// The handler ignores its context: stop renewing the lease and
			// store the timeout (or the cancel) without it; whatever it
			// returns is dropped.
			why := "handler_ignored_timeout"
			if e.cancelled {
				why = "handler_ignored_cancel"
			}
			e.log.ErrorContext(ctx, "handler ignored its context; its outcome will be ignored", "cause", context.Cause(e.hctx))
			e.w.metrics.dropped.WithLabelValues(why).Inc()
			e.closeFence()
			e.finish(ctx, outcome{err: conveyor.ErrTimeout, cause: context.Cause(e.hctx)})
			e.ack()
			// The attempt is over: its span ends now, not when (if ever)
			// the handler returns.
			e.span.End()
			// The slot stays taken while the handler still runs, but a
			// stopping worker's drain does not wait for it.
			select {
			case <-done:
				e.free()
			case <-e.w.abandon:
				go func() { <-done; e.free() }()
			}
			return
		case <-abandon:
			if len(done) > 0 {
				// The handler has returned after all: its outcome is
				// taken at the next turn.
				abandon = nil
				continue
			}
			// The worker is stopping and the handler ignored ErrShutdown
			// for as long as the drain waits: the task is handed back
			// without it (or ends as its cause says: cancelled, timed out,
			// lost), before the worker exits.
			e.log.ErrorContext(ctx, "handler ignored the shutdown; its task is handed back without it", "cause", context.Cause(e.hctx))
			e.w.metrics.dropped.WithLabelValues("handler_ignored_shutdown").Inc()
			e.closeFence()
			e.finish(ctx, outcome{err: conveyor.ErrShutdown, cause: context.Cause(e.hctx)})
			e.ack()
			e.span.End()
			go func() { <-done; e.free() }()
			return
		}
	}
}

// clocks are the times at which an attempt's run loop has something to
// do; a zero time is a clock not running.
type clocks struct {
	beat, long, deadline, silent time.Time
	// every is the heartbeat's interval.
	every time.Duration
}

// next is the earliest running clock. The heartbeat always runs.
func (c clocks) next() time.Time {
	next := c.beat
	if !c.long.IsZero() && c.long.Before(next) {
		next = c.long
	}
	if !c.deadline.IsZero() && c.deadline.Before(next) {
		next = c.deadline
	}
	if !c.silent.IsZero() && c.silent.Before(next) {
		next = c.silent
	}
	return next
}

// take says which clocks are due at now (the timer's time): the
// heartbeat starts over from the moment it is taken, so a loop that was
// held up renews once, not once for each interval it missed; the others
// stop.
func (c *clocks) take(now time.Time) (beat, long, deadline, silent bool) {
	due := func(t *time.Time) bool {
		if t.IsZero() || t.After(now) {
			return false
		}
		*t = time.Time{}
		return true
	}
	if beat = due(&c.beat); beat {
		c.beat = time.Now().Add(c.every)
	}
	return beat, due(&c.long), due(&c.deadline), due(&c.silent)
}

// errNoSlot stops a task claimed ahead that found no free slot in time.
var errNoSlot = errors.New("no free slot on this worker")

// The values of execution.start.
const (
	startWaiting int32 = iota
	startBegun
	startGivenUp
)

// takeSlot waits for a slot to run the handler in. It gives up when the
// handler's context ends first (a cancel, no slot in time) or the worker
// stops taking work; a task that never started is handed back.
func (e *execution) takeSlot() bool {
	// A stopping worker starts nothing, even with a slot free: a select
	// that finds both ready picks either.
	select {
	case <-e.w.stopping:
		e.stop(conveyor.ErrShutdown)
		return false
	default:
	}
	select {
	case e.w.slots <- struct{}{}:
	case <-e.hctx.Done():
		return false
	case <-e.w.stopping:
		e.stop(conveyor.ErrShutdown)
		return false
	}
	e.slotted = true
	return e.hctx.Err() == nil && e.start.CompareAndSwap(startWaiting, startBegun)
}

// free frees the handler's slot and the delivery's place in the window,
// once the handler has returned.
func (e *execution) free() {
	if e.slotted {
		<-e.w.slots
		e.w.freed.Add(1)
	}
	e.release()
}

// runTime is how long the attempt may run: the task's own timeout, within
// the worker's maximum.
func (e *execution) runTime() time.Duration {
	if t := e.task.Timeout; t > 0 && t < e.w.cfg.MaxRunTime {
		return t
	}
	return e.w.cfg.MaxRunTime
}

// ack settles the delivery, once, after the outcome is stored: until then
// the broker counts it against the worker's prefetch. A task of a packed
// message was settled when it was claimed, and this does nothing more.
func (e *execution) ack() {
	if !e.acked {
		e.acked = true
		_ = e.delivery.Ack()
	}
}

// call runs the handler, turning a panic into an error.
// errHandlerExited: the handler ended its goroutine without returning. It
// counts as an error of the attempt, retried like any other.
var errHandlerExited = errors.New("the handler exited its goroutine (runtime.Goexit) without returning")

func (e *execution) call() (out outcome) {
	defer e.returned.Store(true) // a panic or runtime.Goexit ends the handler too
	defer func() {
		if v := recover(); v != nil {
			out = outcome{err: &conveyor.PanicError{Value: v, Stack: debug.Stack()}}
		}
	}()
	t := conveyor.Task{
		ID: e.task.ID, Type: e.task.Type, Payload: e.task.Payload, Metadata: e.task.Metadata,
		Attempt: e.task.Attempt, MaxAttempts: e.task.MaxAttempts, Node: e.task.Node,
	}
	if e.task.RunID != nil {
		t.Run = *e.task.RunID
		var in struct {
			Params  json.RawMessage            `json:"params"`
			Parents map[string]json.RawMessage `json:"parents"`
		}
		if err := json.Unmarshal(e.task.Inputs, &in); err != nil {
			return outcome{err: conveyor.Permanent(fmt.Errorf("the run's inputs cannot be read: %w", err))}
		}
		t.Params, t.Parents = in.Params, in.Parents
	}
	if e.task.ParentID != nil {
		t.Parent = *e.task.ParentID
	}
	result, err := e.handler(e.hctx, t, e)
	e.returned.Store(true) // before the result's encoding, also the handler's code
	out = outcome{result: result, err: err}
	if err == nil {
		out.encoded, out.encodeErr = json.Marshal(result)
	} else {
		// The error's methods are the handler's code too, read here so
		// that a panic of theirs (a typed nil pointer's Error, say) is
		// recovered, as the result's encoding is: finish reads them again
		// in the run loop, where nothing would.
		_, _, _ = err.Error(), conveyor.IsPermanent(err), errors.Is(err, conveyor.ErrAwaitChildren)
	}
	return out
}

var childKey = regexp.MustCompile(task.ChildKeyPattern)

// Gather implements conveyor.Reporter: it submits the children not
// submitted yet and returns their outcomes once all have finished.
// Children it refuses are refused on every attempt: that error is
// Permanent.
func (e *execution) Gather(ctx context.Context, children ...conveyor.Child) ([]conveyor.ChildResult, error) {
	if err := e.usable(); err != nil {
		return nil, err
	}
	// One call is one transaction of the spawn: bounded as the API bounds
	// a batch, so that a handler's loop gone wrong cannot hold the
	// parent's row and the worker's memory for a million children, and
	// time out, on every attempt.
	if len(children) > conveyor.MaxGatherChildren {
		return nil, conveyor.Permanent(fmt.Errorf("%d children in one Gather, more than the limit of %d: "+
			"spawn them in several calls", len(children), conveyor.MaxGatherChildren))
	}
	subs := make([]task.Submission, len(children))
	seen := make(map[string]bool, len(children))
	stored := 0
	for i, c := range children {
		if !childKey.MatchString(c.Key) {
			return nil, conveyor.Permanent(fmt.Errorf("child %d: key %q must match %s", i, c.Key, task.ChildKeyPattern))
		}
		if seen[c.Key] {
			return nil, conveyor.Permanent(fmt.Errorf("child %d: key %q given twice", i, c.Key))
		}
		seen[c.Key] = true
		payload, err := json.Marshal(c.Payload)
		if err != nil {
			return nil, conveyor.Permanent(fmt.Errorf("child %s: payload: %w", c.Key, err))
		}
		in := task.SubmitInput{Type: c.Type, Payload: payload, Priority: &e.task.Priority, Dedupe: new(bool)}
		// Only 0 means the default: a negative count is refused with the
		// submission's reason, as one above the most is.
		if c.MaxAttempts != 0 {
			in.MaxAttempts = &c.MaxAttempts
		}
		sub, err := task.NewSubmission(in, task.Defaults{MaxAttempts: task.DefaultMaxAttempts}, "")
		if err != nil {
			return nil, conveyor.Permanent(fmt.Errorf("child %s: %w", c.Key, err))
		}
		if stored += sub.StoredBytes; stored > task.MaxBatchStoredBytes {
			return nil, conveyor.Permanent(fmt.Errorf("child %s: the payloads of one Gather take more than the limit of %d bytes as stored: "+
				"spawn the children in several calls", c.Key, task.MaxBatchStoredBytes))
		}
		sub.OrgID, sub.Visibility, sub.ParentID, sub.ChildKey = e.task.OrgID, e.task.Visibility, &e.task.ID, c.Key
		subs[i] = sub
	}
	// Encoding the payloads runs the caller's code (MarshalJSON), for as
	// long as it takes: a handler that returned meanwhile has its outcome
	// being stored, and children spawned now would run for a task that is
	// ending.
	if err := e.usable(); err != nil {
		return nil, err
	}
	tctx := ctx
	if !trace.SpanContextFromContext(ctx).IsValid() {
		// A context of the handler's own making: the children still hang
		// under the attempt, not in no trace at all.
		tctx = trace.ContextWithSpan(ctx, e.span)
	}
	sctx, cancel := context.WithTimeout(tctx, e.w.cfg.Lease)
	defer cancel()
	states, err := e.w.store.Spawn(sctx, e.task, subs, e.w.inject(tctx))
	if err != nil {
		return nil, fmt.Errorf("spawn children: %w", err)
	}
	byKey := make(map[string]task.ChildState, len(states))
	for _, s := range states {
		byKey[s.Key] = s
	}
	out := make([]conveyor.ChildResult, len(children))
	running := 0
	for i, c := range children {
		s := byKey[c.Key]
		out[i] = conveyor.ChildResult{Key: c.Key, TaskID: s.ID, Status: string(s.Status), Result: s.Result, Error: s.Error}
		if !s.Status.Terminal() {
			running++
		}
	}
	if running > 0 {
		e.awaiting.Store(true)
		return out, fmt.Errorf("%w: %d of %d still running", conveyor.ErrAwaitChildren, running, len(children))
	}
	return out, nil
}

// write applies a change of the held task at the lease's version, through
// the worker's batch of changes. A connection that hangs must not freeze
// the run loop (the lease would expire anyway): the wait to get into a
// batch, and the batch's statement, each take at most one lease. On
// success the lease takes the new version.
func (e *execution) write(ctx context.Context, c task.Change) error {
	c.TaskID, c.Version = e.lease.TaskID, e.lease.Version
	if c.Lease == 0 {
		c.Lease = e.w.cfg.Lease
	}
	do := e.w.changes.do
	if e.task.ParentID != nil || e.task.RunID != nil {
		// Settling the task locks its parent or its run as well.
		do = e.w.changes.doLinked
	}
	sent := time.Now()
	applied, err := do(ctx, c)
	if err != nil {
		return err
	}
	if applied.Fenced {
		return task.ErrFenced
	}
	e.lease.Version = applied.Version
	if task.Lifecycle[c.Transition].Lease {
		e.mu.Lock()
		if sent.After(e.renewed) {
			e.renewed = sent
		}
		e.mu.Unlock()
	}
	return nil
}

// reportWaiting says a progress report is waiting to be stored.
func (e *execution) reportWaiting() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.latest != nil && !e.cancelled
}

// flushProgress stores the latest report, if any.
func (e *execution) flushProgress(ctx context.Context) {
	e.noteExpired(ctx)
	e.mu.Lock()
	p := e.latest
	e.latest = nil
	e.mu.Unlock()
	if p == nil || e.lost || e.cancelled {
		return
	}
	c := task.Change{Transition: task.Progress, Progress: p.percent, State: p.state}
	// The report is in the trace already, as the span's progress event;
	// its write, up to a few a second for as long as the handler reports,
	// is not traced.
	wctx := untraced(ctx)
	err := e.write(wctx, c)
	if errors.Is(err, task.ErrFenced) {
		// The fence may have missed only because an earlier write of ours
		// landed though its answer said it failed: the task is then still
		// ours, one version on, and the report is written again at that
		// version rather than dropped. A cancel or a loss drops it; a
		// failed read keeps it for the next try.
		owned, rerr := e.reclaim(ctx)
		switch {
		case rerr != nil:
			err = rerr
		case !owned || e.cancelled:
			return
		default:
			err = e.write(wctx, c)
		}
	}
	if err != nil && !errors.Is(err, task.ErrFenced) {
		// Keep it for the next try unless a newer report replaced it,
		// whose percentage it still raises.
		e.mu.Lock()
		if e.latest == nil {
			e.latest = p
		} else {
			e.latest.percent = max(e.latest.percent, p.percent)
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
		// next heartbeat, for as long as the lease lasts (watchLease).
		e.log.WarnContext(ctx, "task write failed; will retry", "error", err)
	}
}

// reclaim reads the task after a fenced write missed. If it is still ours
// because a cancel was requested, it adopts the new version, stops the
// handler and reports owned. If it is still ours, one version on, with no
// cancel pending, a write of ours landed though its answer said it failed
// (a commit whose reply was lost, a batch reported failed after its
// changes committed): it adopts that version and reports owned, and the
// handler runs on. Otherwise the task is lost and the handler stopped.
// err is a failed read: nothing is decided.
func (e *execution) reclaim(ctx context.Context) (owned bool, err error) {
	rctx, cancel := context.WithTimeout(ctx, e.w.cfg.Lease)
	hold, err := e.w.store.Inspect(rctx, e.lease.TaskID)
	cancel()
	if err != nil && !errors.Is(err, task.ErrNotFound) {
		return false, err
	}
	if err == nil && hold.Owns(e.lease) && hold.CancelRequested {
		e.lease.Version = hold.Version
		e.markCancelled(ctx)
		return true, nil
	}
	// Exactly one version on: any other writer's change (a cancel, the
	// reaper's expiry) would show, and a later run of the task would have
	// a new attempt.
	if err == nil && hold.Owns(e.lease) && hold.Version == e.lease.Version+1 {
		e.log.InfoContext(ctx, "a write reported failed had landed; the task is still ours", "version", hold.Version)
		e.lease.Version = hold.Version
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

// finish stores the attempt's outcome as the lifecycle's transition for it.
func (e *execution) finish(ctx context.Context, out outcome) {
	cause := context.Cause(e.hctx)
	e.noteExpired(ctx)
	// The handler's last progress report lands before the outcome, also
	// when it was stopped (a timeout, the shutdown's grace): it was
	// accepted. A task cancelled or lost stores none (flushProgress).
	e.flushProgress(ctx)
	// A panic is logged whatever the attempt's outcome: one in the code a
	// cancel or a timeout runs is a bug too, and the outcome stored says
	// nothing of it.
	var p *conveyor.PanicError
	if errors.As(out.err, &p) {
		e.log.ErrorContext(ctx, "handler panicked", "panic", fmt.Sprint(p.Value), "stack", string(p.Stack))
	}
	if e.lost {
		e.done(ctx, "lost", nil)
		return
	}
	switch {
	case e.cancelled || errors.Is(cause, conveyor.ErrCancelled):
		e.store(ctx, "cancelled", task.Change{Transition: task.HonourCancel})
	case errors.Is(out.cause, conveyor.ErrShutdown) && out.err != nil, errors.Is(out.cause, errNoSlot):
		// A handler that returns a result as the grace period ends has
		// done its work: it completes below rather than running again.
		// One that returned before the grace ended has its outcome
		// stored as it is, however late the loop takes it.
		reason := "worker shutting down"
		if errors.Is(out.cause, errNoSlot) {
			reason = errNoSlot.Error()
		}
		e.store(ctx, "handed_back", task.Change{Transition: task.HandBack, Trace: e.w.inject(ctx),
			Detail: map[string]any{"handed_back": reason, "attempt": e.task.Attempt}})
	case e.timedOut:
		e.fail(ctx, fmt.Errorf("%w after %s", conveyor.ErrTimeout, e.runTime()), false)
	case e.silent:
		e.fail(ctx, fmt.Errorf("heartbeat timed out: no heartbeat from the handler for %s", e.task.HeartbeatTimeout), false)
	case errors.Is(out.err, conveyor.ErrAwaitChildren) && e.awaiting.Load():
		e.store(ctx, "awaiting", task.Change{Transition: task.Await,
			Detail: map[string]any{"attempt": e.task.Attempt, "waiting": out.err.Error()}})
	case errors.Is(out.err, conveyor.ErrAwaitChildren):
		// No child of this attempt runs, so none would wake the task: it
		// would be queued again and again, using no attempt. A handler
		// returns the error Gather gave it, not one of its own.
		e.fail(ctx, fmt.Errorf("%w, but Gather reported no child still running: return the error Gather returns",
			out.err), true)
	case out.err == nil:
		result, err := out.encoded, out.encodeErr
		if err == nil {
			err = task.StorableJSON(result)
		}
		if err != nil {
			e.fail(ctx, fmt.Errorf("result cannot be stored: %w", err), true)
			return
		}
		e.store(ctx, "completed", task.Change{Transition: task.Complete, Result: result,
			Detail: map[string]any{"attempt": e.task.Attempt}})
	default:
		e.fail(ctx, out.err, conveyor.IsPermanent(out.err))
	}
}

// fail ends the attempt in error: FAILED when the error is permanent or no
// attempt is left, otherwise PENDING again after a backoff.
func (e *execution) fail(ctx context.Context, err error, permanent bool) {
	reason := task.CleanText(err.Error(), task.MaxErrorLen)
	e.span.RecordError(err)
	detail := map[string]any{"attempt": e.task.Attempt, "error": reason}
	if task.OnFailure(permanent, e.task.Attempt, e.task.MaxAttempts) == task.Fail {
		detail["permanent"] = permanent
		e.log.InfoContext(ctx, "attempt failed; task failed", "error", reason, "permanent", permanent)
		e.store(ctx, "failed", task.Change{Transition: task.Fail, Error: reason, Detail: detail})
		return
	}
	delay := retryDelay(e.task.Attempt, e.w.cfg.BackoffBase, e.w.cfg.BackoffMax)
	detail["retry_in"] = delay.String()
	e.log.InfoContext(ctx, "attempt failed; retry scheduled", "error", reason, "retry_in", delay)
	e.store(ctx, "retried", task.Change{Transition: task.RetryLater, Error: reason, Delay: delay,
		Trace: e.w.retryTrace(ctx, e.task), Detail: detail})
}

// store makes the outcome's change. If its fence misses because a cancel
// was requested meanwhile, the task ends CANCELLED instead: a task whose
// cancellation was accepted never completes nor runs again. A change the
// database refuses for its data fails the attempt with that reason. A
// database that does not answer is retried until it does, or until a
// stopping worker gives up its tasks: the change is fenced by the task's
// version, so it lands only if no one moved the task on meanwhile, and the
// lease reaper cannot run while the database is down either. Given up
// after a lease, an outcome already won was thrown away, and a task on its
// last attempt that had completed was failed by the reaper once the
// database was back. Past a lease the delivery is settled all the same:
// the database holds the task, and a write that never lands must not keep
// the broker's credit.
func (e *execution) store(ctx context.Context, outcome string, c task.Change) {
	b := wait.Backoff(100*time.Millisecond, e.w.cfg.ReconnectBackoffMax)
	deadline := time.Now().Add(e.w.cfg.Lease)
	for {
		if err := c.Storable(); err != nil {
			// Only a result can be unstorable; fail with why.
			c = task.Change{Transition: task.Fail, Error: "result cannot be stored: " + err.Error(),
				Detail: map[string]any{"attempt": e.task.Attempt, "permanent": true}}
			outcome = "failed"
		}
		err := e.write(ctx, c)
		switch {
		case err == nil:
			if outcome == "cancelled" {
				// Here, not where the outcome was chosen: a cancel the
				// worker learns of only as this write misses its fence
				// ends here too, and one whose task was lost meanwhile
				// was never stored CANCELLED.
				e.w.metrics.cancelLatency.Observe(time.Since(e.cancelledAt).Seconds())
			}
			e.done(ctx, outcome, nil)
			return
		case errors.Is(err, task.ErrFenced):
			owned, rerr := e.reclaim(ctx)
			if rerr == nil && !owned {
				e.done(ctx, "lost", err)
				return
			}
			if rerr == nil {
				if e.cancelled {
					outcome, c = "cancelled", task.Change{Transition: task.HonourCancel}
				}
				continue
			}
			err = rerr
		case task.ErrorCode(err) == task.ErrCodeInvalid && c.Transition != task.Fail:
			// PostgreSQL refused this outcome's data: fail the attempt
			// with its real reason instead of leaving the task to the
			// lease reaper.
			e.log.WarnContext(ctx, "outcome refused by the database; failing the attempt", "outcome", outcome, "error", err)
			c = task.Change{Transition: task.Fail, Error: "outcome could not be stored: " + err.Error(),
				Detail: map[string]any{"attempt": e.task.Attempt, "permanent": true}}
			outcome = "failed"
			continue
		}
		if time.Now().After(deadline) {
			e.ack()
		}
		retry := b.NextBackOff()
		e.log.WarnContext(ctx, "storing outcome failed; retrying", "outcome", outcome, "error", err, "retry_in", retry)
		select {
		case <-time.After(retry):
		case <-e.w.abandon:
			e.done(ctx, "abandoned", err)
			return
		}
	}
}

// done logs and counts the end of the attempt.
func (e *execution) done(ctx context.Context, outcome string, err error) {
	e.w.metrics.finished.WithLabelValues(e.task.Type, outcome).Inc()
	e.w.metrics.duration.WithLabelValues(e.task.Type, outcome).Observe(time.Since(e.started).Seconds())
	e.span.SetAttributes(attribute.String("conveyor.outcome", outcome))
	e.w.signals.finished.send(finished{taskID: e.task.ID, outcome: outcome})
	if err != nil {
		e.span.SetStatus(codes.Error, err.Error())
		e.log.WarnContext(ctx, "task attempt ended", "outcome", outcome, "error", err)
		return
	}
	switch outcome {
	case "failed":
		e.span.SetStatus(codes.Error, "task failed")
	case "retried":
		// The attempt failed, though the task runs again (in a trace of
		// its own): its span is an error as the last attempt's is.
		e.span.SetStatus(codes.Error, "attempt failed; retry scheduled")
	}
	// A completion is the common case, counted in the metrics and kept in
	// the task's events: it is logged at debug level, every other outcome
	// at info.
	level := slog.LevelInfo
	if outcome == "completed" {
		level = slog.LevelDebug
	}
	e.log.log(ctx, level, "task attempt ended", []any{"outcome", outcome, "duration", time.Since(e.started)})
}

// retryDelay is the wait before attempt+1: base doubled per attempt, capped,
// with "equal jitter" (between half and all of it) so that tasks failing
// together do not retry together.
func retryDelay(attempt int, base, limit time.Duration) time.Duration {
	d := base
	for i := 1; i < attempt && d < limit; i++ {
		if d > limit/2 { // doubled, it would pass the cap (or overflow)
			d = limit
			break
		}
		d *= 2
	}
	d = min(d, limit)
	half := d / 2
	return half + rand.N(d-half+1)
}
