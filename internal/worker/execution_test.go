package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	oteltrace "go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/registry"
	"github.com/conveyorhq/conveyor/internal/task"
)

func TestRetryDelayDoublesWithJitterUpToTheCap(t *testing.T) {
	t.Parallel()
	base, limit := time.Second, 10*time.Second
	for _, tc := range []struct {
		attempt int
		full    time.Duration
	}{
		{1, time.Second}, {2, 2 * time.Second}, {3, 4 * time.Second}, {4, 8 * time.Second},
		{5, 10 * time.Second}, {50, 10 * time.Second},
	} {
		seen := map[time.Duration]bool{}
		for range 200 {
			d := retryDelay(tc.attempt, base, limit)
			require.GreaterOrEqual(t, d, tc.full/2, "attempt %d", tc.attempt)
			require.LessOrEqual(t, d, tc.full, "attempt %d", tc.attempt)
			seen[d] = true
		}
		require.Greater(t, len(seen), 100, "attempt %d: jittered", tc.attempt)
	}
}

// RETRY_BACKOFF_MAX takes durations of millions of hours: doubling the
// delay toward such a cap must not overflow into a negative one, which
// made the jitter panic and the worker crash at a task's fifth failure.
func TestRetryDelayDoesNotOverflowTowardAHugeCap(t *testing.T) {
	t.Parallel()
	base, limit := 200000*time.Hour, 2500000*time.Hour
	for attempt := 1; attempt <= 70; attempt++ {
		d := retryDelay(attempt, base, limit)
		require.GreaterOrEqual(t, d, base/2, "attempt %d", attempt)
		require.LessOrEqual(t, d, limit, "attempt %d", attempt)
	}
}

// A progress report whose write misses its fence only because an earlier
// write of the worker landed unbeknown to it (a renewal whose commit reply
// was lost) is not dropped: the task is found still the worker's, and the
// report lands at the version adopted. The latest value always lands.
func TestWorkerStoresAProgressReportFencedByItsOwnLandedWrite(t *testing.T) {
	renewLost := make(chan struct{})
	release := make(chan struct{})
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.progress", func(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
			<-renewLost
			require.NoError(t, r.Progress(ctx, 50, "Half way"))
			<-release
			return nil, nil
		}),
	}})
	var lost atomic.Bool
	b.store.mu.Lock()
	b.store.loseReply = func(c task.Change) bool {
		if c.Transition == task.Renew && lost.CompareAndSwap(false, true) {
			close(renewLost)
			return true
		}
		return false
	}
	b.store.mu.Unlock()
	id := b.store.add("t.progress", 3)
	b.deliver(t, id)
	defer close(release)
	require.Eventually(t, func() bool { return b.store.get(id).Progress == 50 }, waitLimit, 5*time.Millisecond,
		"the report fenced by the worker's own landed renewal was dropped")
	require.Equal(t, "Half way", b.store.get(id).State)
	require.Equal(t, task.StatusInProgress, b.store.get(id).Status)
}

// conveyor.Handler's fields are exported, so a handler may be built without
// conveyor.Handle: the worker refuses at start-up what Handle would have,
// instead of consuming a queue no task can reach or failing every task of
// a type with a nil function's panic.
func TestWorkerRefusesAHandlerHandleWouldRefuse(t *testing.T) {
	t.Parallel()
	fn := func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) { return nil, nil }
	for _, h := range []conveyor.Handler{
		{Type: "t.nil"},
		{Type: "", Func: fn},
		{Type: "Has Space", Func: fn},
	} {
		_, err := New(Config{Concurrency: 1}, fakeDeps(newFakeStore(), newFakeBroker()), []conveyor.Handler{h})
		require.Error(t, err, "handler %+v", h)
	}
	_, err := New(Config{Concurrency: 1}, fakeDeps(newFakeStore(), newFakeBroker()), []conveyor.Handler{{Type: "t.ok", Func: fn}})
	require.NoError(t, err)
}

// A handler that returned within its run time completes, though the run
// loop was busy (a slow write) when the run time ran out: the outcome was
// there first, and the attempt did not time out.
func TestWorkerCompletesAHandlerThatReturnedBeforeItsRunTimeWhileAWriteWasSlow(t *testing.T) {
	const tasks = 8
	// The handler takes 15 ms of its 200: a busy machine may hold it up a
	// while without its outcome coming after the run time.
	b := setup(t, testConfig{concurrency: tasks, maxRunTime: 200 * time.Millisecond, handlers: []conveyor.Handler{
		conveyor.Handle("t.quick", func(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
			time.Sleep(5 * time.Millisecond) // the run loop has started the run time's clock
			require.NoError(t, r.Progress(ctx, 50, "Half way"))
			time.Sleep(10 * time.Millisecond) // the report's write is under way
			return "done in time", nil
		}),
	}})
	ids := make([]uuid.UUID, tasks)
	for i := range ids {
		ids[i] = b.store.add("t.quick", 1)
	}
	// Every write now outlasts the run time.
	b.store.mu.Lock()
	b.store.writeTime = 400 * time.Millisecond
	b.store.mu.Unlock()
	for _, id := range ids {
		b.deliver(t, id)
	}
	for _, id := range ids {
		require.Equal(t, "completed", b.finished(t, id), "the handler returned after 15 ms of its 200")
	}
}

// A handler that failed for good before the shutdown's grace ran out fails
// its task, though the run loop was busy (a slow write) when the grace
// ended: its outcome was there first, and the task is not handed back to
// run again.
func TestWorkerFailsAHandlerThatFailedBeforeTheGraceEndedWhileAWriteWasSlow(t *testing.T) {
	failing := make(chan struct{})
	entered := make(chan struct{}, 1)
	b := setup(t, testConfig{heartbeat: 300 * time.Millisecond, handlers: []conveyor.Handler{
		conveyor.Handle("t.fail", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
			entered <- struct{}{}
			<-failing
			return nil, conveyor.Permanent(errors.New("bad input"))
		}),
	}})
	id := b.store.add("t.fail", 3)
	b.deliver(t, id)
	receive(t, entered)
	// The first lease renewal, 300 ms after the start, outlasts the grace
	// (1 s) and holds the run loop past it; the writes after it are quick.
	b.store.mu.Lock()
	b.store.writeTime = 1500 * time.Millisecond
	b.store.mu.Unlock()
	time.Sleep(400 * time.Millisecond) // the renewal is under way
	b.store.mu.Lock()
	b.store.writeTime = 0
	b.store.mu.Unlock()
	b.cancel()     // SIGTERM: the grace starts
	close(failing) // the handler fails, well within it
	require.Equal(t, "failed", b.finished(t, id))
	require.Equal(t, task.StatusFailed, b.store.get(id).Status)
}

// A cancel broadcast of the current run that arrives while a stale one
// (of an earlier run) still waits for the run loop is not dropped behind
// it: the loop gets the newest version, and stops the handler at once
// rather than at the next lease renewal.
func TestACancelBroadcastIsNotDroppedBehindAStaleOne(t *testing.T) {
	t.Parallel()
	w := &Worker{cfg: Config{Info: registry.Worker{ID: "w1"}}}
	e := w.newExecution(task.Task{ID: uuid.New(), Attempt: 2, Version: 7}, nil, taskLog{}, nil, outbox.Delivery{}, time.Now())
	e.requestCancel(5) // a late broadcast of the earlier run's cancel
	e.requestCancel(8) // this run's cancel
	require.Equal(t, 8, <-e.cancel)
	e.requestCancel(9)
	e.requestCancel(8) // a duplicate arriving late keeps the newest
	require.Equal(t, 9, <-e.cancel)
}

// A delivery taken before the worker began to stop, whose claim lands
// after, is not started, though a slot is free: the worker takes no new
// work once stopping, and the task is handed back at once for another
// worker, instead of starting a handler that the grace period may cut.
func TestWorkerStartsNoHandlerOnceStopping(t *testing.T) {
	const tasks = 8
	h := newBlocking()
	b := setup(t, testConfig{concurrency: tasks, handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	ids := make([]uuid.UUID, tasks)
	for i := range ids {
		ids[i] = b.store.add("t.block", 3)
	}
	// The claims are still being written when the worker begins to stop.
	b.store.mu.Lock()
	b.store.writeTime = 200 * time.Millisecond
	b.store.mu.Unlock()
	for _, id := range ids {
		b.deliver(t, id)
	}
	b.cancel()
	for _, id := range ids {
		require.Equal(t, "handed_back", b.finished(t, id))
	}
	require.Zero(t, len(h.entered), "handlers started after the worker began to stop")
}

// A claim reported failed as the worker begins to stop may have landed:
// the task is then handed back with its attempt, not left held by a
// stopped worker until its lease expires (a task of one attempt would then
// fail without ever running).
func TestWorkerHandsBackATaskWhoseClaimLandedAsItStopped(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 1)
	var lost atomic.Bool
	b.store.mu.Lock()
	b.store.claimReply = func([]uuid.UUID) (bool, bool) {
		if !lost.CompareAndSwap(false, true) {
			return false, false
		}
		b.cancel() // SIGTERM, while the claim's answer is lost
		return true, false
	}
	b.store.mu.Unlock()
	a := b.deliver(t, id)
	require.Equal(t, "handed_back", b.finished(t, id))
	receive(t, a.done)
	got := b.store.get(id)
	require.Equal(t, task.StatusPending, got.Status)
	require.Zero(t, got.Attempt, "the attempt is given back")
	require.Zero(t, len(h.entered), "no handler started once stopping")
}

// A child's MaxAttempts out of range is refused, a negative one as much as
// one above the most: only 0 means the default.
func TestGatherRefusesANegativeMaxAttempts(t *testing.T) {
	errs := make(chan error, 2)
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.parent", func(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
			for _, n := range []int{-1, task.MaxMaxAttempts + 1} {
				_, err := r.Gather(ctx, conveyor.Child{Key: "c", Type: "t.child", MaxAttempts: n})
				errs <- err
			}
			return nil, nil
		}),
	}})
	id := b.store.add("t.parent", 1)
	b.deliver(t, id)
	require.Equal(t, "completed", b.finished(t, id))
	for range 2 {
		err := receive(t, errs)
		require.ErrorContains(t, err, "max_attempts")
	}
}

// A handler's children are traced under its span, also when it hands
// Gather a context of its own that carries no span (context.Background()):
// a child with no trace context would have no trace_id, and each of its
// messages would start a trace of its own at the relay.
func TestGatherTracesChildrenUnderTheAttemptWhateverTheContext(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	done := make(chan struct{}, 2)
	b := setup(t, testConfig{tracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)),
		handlers: []conveyor.Handler{
			conveyor.Handle("t.parent", func(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
				for _, c := range []context.Context{ctx, context.Background()} {
					_, _ = r.Gather(c, conveyor.Child{Key: "c", Type: "t.child"})
					done <- struct{}{}
				}
				return nil, nil
			}),
		}})
	id := b.store.add("t.parent", 1)
	b.deliver(t, id)
	require.Equal(t, "completed", b.finished(t, id))
	receive(t, done)
	receive(t, done)
	b.store.mu.Lock()
	traces := slices.Clone(b.store.spawnTraces)
	b.store.mu.Unlock()
	require.Len(t, traces, 2)
	var consumer sdktrace.ReadOnlySpan
	require.Eventually(t, func() bool {
		for _, s := range rec.Ended() {
			if s.SpanKind() == oteltrace.SpanKindConsumer {
				consumer = s
				return true
			}
		}
		return false
	}, waitLimit, 10*time.Millisecond)
	want := "00-" + consumer.SpanContext().TraceID().String() + "-" + consumer.SpanContext().SpanID().String() + "-01"
	for i, c := range traces {
		require.Equal(t, want, c["traceparent"], "spawn %d: the children hang under the attempt's span", i)
	}
}

// A handler that returns ErrAwaitChildren when Gather said no such thing
// fails its task for good: no child of it runs, so none would wake it, and
// it would be queued again and again without using an attempt.
func TestWorkerFailsAnAwaitWithNoChildRunning(t *testing.T) {
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.await", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
			return nil, conveyor.ErrAwaitChildren
		}),
	}})
	id := b.store.add("t.await", 3)
	b.deliver(t, id)
	require.Equal(t, "failed", b.finished(t, id))
	got := b.store.get(id)
	require.Equal(t, task.StatusFailed, got.Status)
	require.Contains(t, got.Error, "Gather reported no child still running")
}

// Children Gather refuses (a bad key, a key twice, a type or payload the
// API would refuse) are refused again on every attempt: returned as the
// README's fan-out does, the error fails the task at once, instead of
// spending each attempt and its backoff on the same refusal.
func TestWorkerFailsAtOnceOnChildrenGatherRefuses(t *testing.T) {
	for name, children := range map[string][]conveyor.Child{
		"bad key":      {{Key: "part 0", Type: "t.child"}},
		"key twice":    {{Key: "a", Type: "t.child"}, {Key: "a", Type: "t.child"}},
		"bad type":     {{Key: "a", Type: "Not a type!"}},
		"not object":   {{Key: "a", Type: "t.child", Payload: []int{1}}},
		"no encoding":  {{Key: "a", Type: "t.child", Payload: make(chan int)}},
		"max attempts": {{Key: "a", Type: "t.child", MaxAttempts: -1}},
		"too many":     manyChildren(conveyor.MaxGatherChildren+1, nil),
		// 1e308 takes 309 bytes as stored: 3000 of them nearly 1 MiB.
		"too large": manyChildren(task.MaxBatchStoredBytes/(3000*309)+1,
			json.RawMessage(`{"n":[1e308`+strings.Repeat(",1e308", 2999)+`]}`)),
	} {
		t.Run(name, func(t *testing.T) {
			b := setup(t, testConfig{handlers: []conveyor.Handler{
				conveyor.Handle("t.fanout", func(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
					results, err := r.Gather(ctx, children...)
					if err != nil {
						return nil, err
					}
					return len(results), nil
				}),
			}})
			id := b.store.add("t.fanout", 3)
			b.deliver(t, id)
			require.Equal(t, "failed", b.finished(t, id))
			got := b.store.get(id)
			require.Equal(t, task.StatusFailed, got.Status, "%s", got.Error)
			require.Equal(t, 1, got.Attempt)
			if strings.HasPrefix(name, "too ") {
				require.Contains(t, got.Error, "several calls", "the error says how to spawn them")
			}
		})
	}
}

// manyChildren is n children of one payload.
func manyChildren(n int, payload any) []conveyor.Child {
	children := make([]conveyor.Child, n)
	for i := range children {
		children[i] = conveyor.Child{Key: fmt.Sprint("part-", i), Type: "t.child", Payload: payload}
	}
	return children
}

// nilErr is an error type whose Error reads its fields: a nil *nilErr
// returned as an error (Go's typed nil) panics when its text is read.
type nilErr struct{ msg string }

func (e *nilErr) Error() string { return e.msg }

// A handler's error whose Error method panics (a typed nil pointer, the
// common case) is the handler's panic, recovered where it ran: it fails
// the attempt and the worker runs on, instead of crashing the worker's
// process with every task it runs.
func TestWorkerRecoversAPanicInTheErrorsText(t *testing.T) {
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.nilerr", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
			var err *nilErr
			return nil, err
		}),
		conveyor.Handle("t.ok", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) { return 1, nil }),
	}})
	bad := b.store.add("t.nilerr", 1)
	b.deliver(t, bad)
	require.Equal(t, "failed", b.finished(t, bad))
	require.Contains(t, b.store.get(bad).Error, "handler panicked")
	good := b.store.add("t.ok", 3)
	b.deliver(t, good)
	require.Equal(t, "completed", b.finished(t, good))
}

// A Reporter kept by a goroutine of a handler that has returned (its
// outcome being stored) writes nothing: its report is refused rather than
// accepted and then dropped or stored over the outcome, and its Gather
// spawns no children for a task that is ending.
func TestReporterRefusesUseAfterTheHandlerReturned(t *testing.T) {
	finishing, used := make(chan struct{}), make(chan struct{})
	errs := make(chan error, 2)
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.leak", func(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
			go func() {
				defer close(used)
				<-finishing
				errs <- r.Progress(ctx, 50, "Late")
				_, err := r.Gather(ctx, conveyor.Child{Key: "c", Type: "t.child"})
				errs <- err
			}()
			return 1, nil
		}),
	}})
	var once sync.Once
	b.store.mu.Lock()
	b.store.refuse = func(c task.Change) error {
		if c.Transition == task.Complete {
			once.Do(func() { close(finishing); <-used })
		}
		return nil
	}
	b.store.mu.Unlock()
	id := b.store.add("t.leak", 3)
	b.deliver(t, id)
	require.Equal(t, "completed", b.finished(t, id))
	require.Error(t, receive(t, errs), "a report after the handler returned was accepted")
	require.Error(t, receive(t, errs))
	require.Zero(t, b.store.spawns.Load(), "Gather spawned children after the handler returned")
}

// A report made by a goroutine of the handler while the handler returns
// either lands before the outcome or is refused: it is never accepted and
// then dropped. A long state text (cleaned before the report is kept)
// widens the moment between the report's check and its keeping, in which
// the handler returned and its outcome was stored.
func TestReporterNeverAcceptsAReportItDrops(t *testing.T) {
	long := strings.Repeat("x", 32<<20) + "\xff"
	errs := make(chan error, 1)
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.late", func(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
			require.NoError(t, r.Progress(ctx, 10, "Step 1"))
			reporting := make(chan struct{})
			go func() {
				close(reporting)
				errs <- r.Progress(ctx, 50, long)
			}()
			<-reporting
			return nil, conveyor.Permanent(errors.New("given up"))
		}),
	}})
	id := b.store.add("t.late", 3)
	b.deliver(t, id)
	require.Equal(t, "failed", b.finished(t, id))
	if err := receive(t, errs); err == nil {
		require.Equal(t, 50, b.store.get(id).Progress, "a report accepted while the handler returned was dropped")
	}
}

// slowPayload is a child's payload whose encoding waits for a signal.
type slowPayload struct{ wait <-chan struct{} }

func (p slowPayload) MarshalJSON() ([]byte, error) {
	<-p.wait
	return []byte(`{}`), nil
}

// A Gather a goroutine of the handler started as the handler returned
// spawns no children once the handler has returned: its outcome is being
// stored, and children spawned now would run for a task that is ending.
func TestGatherSpawnsNothingOnceTheHandlerReturnedDuringIt(t *testing.T) {
	finishing := make(chan struct{})
	errs := make(chan error, 1)
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.late", func(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
			gathering := make(chan struct{})
			go func() {
				close(gathering)
				_, err := r.Gather(ctx, conveyor.Child{Key: "c", Type: "t.child", Payload: slowPayload{wait: finishing}})
				errs <- err
			}()
			<-gathering
			return 1, nil
		}),
	}})
	var once sync.Once
	b.store.mu.Lock()
	b.store.refuse = func(c task.Change) error {
		if c.Transition == task.Complete {
			// The outcome is being stored; Gather's encoding goes on,
			// and its spawn is answered before the outcome lands.
			once.Do(func() {
				close(finishing)
				deadline := time.Now().Add(waitLimit)
				for b.store.spawns.Load() == 0 && len(errs) == 0 && time.Now().Before(deadline) {
					time.Sleep(time.Millisecond)
				}
			})
		}
		return nil
	}
	b.store.mu.Unlock()
	id := b.store.add("t.late", 3)
	b.deliver(t, id)
	require.Equal(t, "completed", b.finished(t, id))
	require.Zero(t, b.store.spawns.Load(), "Gather spawned children after the handler returned")
}

// Progress never goes backwards within an attempt: a lower report keeps
// the higher value, its state text still lands. That holds too when the
// higher report was still waiting for its turn (PROGRESS_MIN_INTERVAL)
// as the lower one replaced it.
func TestWorkerKeepsTheHigherProgressOfReportsThatWaitedTogether(t *testing.T) {
	release := make(chan struct{})
	stored := make(chan struct{})
	b := setup(t, testConfig{progressInterval: 300 * time.Millisecond, handlers: []conveyor.Handler{
		conveyor.Handle("t.progress", func(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
			require.NoError(t, r.Progress(ctx, 10, "Step 1"))
			<-stored // the first report is written; the next ones wait for their turn
			require.NoError(t, r.Progress(ctx, 80, "Step 8"))
			require.NoError(t, r.Progress(ctx, 20, "Retrying step 2"))
			<-release
			return nil, nil
		}),
	}})
	id := b.store.add("t.progress", 3)
	b.deliver(t, id)
	require.Eventually(t, func() bool { return b.store.get(id).Progress == 10 }, waitLimit, time.Millisecond)
	close(stored)
	require.Eventually(t, func() bool { return b.store.get(id).State == "Retrying step 2" }, waitLimit, time.Millisecond)
	require.Equal(t, 80, b.store.get(id).Progress, "the higher report was lost behind a lower one")
	close(release)
	require.Equal(t, "completed", b.finished(t, id))
}

// A report whose write failed is kept for the next try; when a lower one
// came meanwhile, the percentage of the failed one is not lost behind it.
func TestWorkerKeepsTheHigherProgressOfAReportWhoseWriteFailed(t *testing.T) {
	release, writing, reported := make(chan struct{}), make(chan struct{}), make(chan struct{})
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.progress", func(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
			require.NoError(t, r.Progress(ctx, 80, "Step 8"))
			<-writing // the report of 80 is being written, and that write fails
			require.NoError(t, r.Progress(ctx, 20, "Retrying step 2"))
			close(reported)
			<-release
			return nil, nil
		}),
	}})
	var failed atomic.Bool
	b.store.mu.Lock()
	b.store.refuse = func(c task.Change) error {
		if c.Transition == task.Progress && failed.CompareAndSwap(false, true) {
			close(writing)
			<-reported
			return errors.New("the database did not answer")
		}
		return nil
	}
	b.store.mu.Unlock()
	id := b.store.add("t.progress", 3)
	b.deliver(t, id)
	defer close(release)
	require.Eventually(t, func() bool { return b.store.get(id).State == "Retrying step 2" }, waitLimit, time.Millisecond)
	require.Equal(t, 80, b.store.get(id).Progress, "the failed report's percentage was lost behind a lower one")
}

// A handler that ignores ErrShutdown does not leave its task to its
// lease: the stopping worker hands the task back, its attempt given back,
// before it exits. Left to the lease, the attempt was spent, and a task on
// its last attempt failed for a deployment's restart.
func TestWorkerHandsBackATaskWhoseHandlerIgnoresTheShutdown(t *testing.T) {
	h := newBlocking()
	h.ignore = true
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	t.Cleanup(func() { close(h.release) })
	id := b.store.add("t.block", 1)
	a := b.deliver(t, id)
	receive(t, h.entered)
	b.cancel() // SIGTERM
	select {
	case <-b.done:
	case <-time.After(waitLimit):
		t.Fatal("the worker did not stop")
	}
	got := b.store.get(id)
	require.Equal(t, task.StatusPending, got.Status, "the task is handed back")
	require.Zero(t, got.Attempt, "the attempt is given back")
	require.Equal(t, "ack", a.how(), "the delivery is settled before the worker exits")
	require.Equal(t, "handed_back", b.finished(t, id))
}

// An outcome the database cannot take while it is down is written once it
// is back, however long that took: the write is fenced by the task's
// version, so it lands only if no one moved the task on meanwhile. Given
// up after a lease, the work was lost, and a task on its last attempt that
// had succeeded was failed by the lease reaper.
func TestWorkerStoresAnOutcomeOnceTheDatabaseIsBackAfterALease(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{heartbeat: 20 * time.Millisecond, handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 1)
	a := b.deliver(t, id)
	receive(t, h.entered)
	b.store.mu.Lock()
	b.store.outage = 3 * b.w.cfg.Lease
	b.store.mu.Unlock()
	close(h.release)
	require.Equal(t, "completed", b.finished(t, id))
	require.Equal(t, task.StatusCompleted, b.store.get(id).Status)
	receive(t, a.done)
}

// While the database stays down, an outcome waiting to be written does not
// keep its delivery's broker credit past a lease: the delivery is settled
// (the database holds the task), and a stopping worker gives the write up.
func TestWorkerSettlesTheDeliveryOfAnOutcomeTheDatabaseCannotTakeForALease(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{heartbeat: 20 * time.Millisecond, handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 1)
	a := b.deliver(t, id)
	receive(t, h.entered)
	b.store.mu.Lock()
	b.store.outage = time.Hour
	b.store.mu.Unlock()
	close(h.release)
	receive(t, a.done)
	require.Equal(t, "ack", a.how())
	require.Equal(t, task.StatusInProgress, b.store.get(id).Status, "the outcome waits for the database")
	b.cancel()
	require.Equal(t, "abandoned", b.finished(t, id))
}

// A worker cut off from the database cannot renew its lease: once a lease
// has passed on its own clock since the last renewal it sent that landed,
// the reaper may hand the task to another worker, so the handler is
// stopped as lost rather than run beside the next attempt. What it returns
// is not written, even once the database is back: the task is the
// reaper's to end.
func TestWorkerStopsAHandlerWhoseLeaseRanOutUnrenewed(t *testing.T) {
	causes := make(chan error, 1)
	handle := func(ctx context.Context, _ conveyor.Task, _ conveyor.Reporter) (any, error) {
		<-ctx.Done()
		causes <- context.Cause(ctx)
		return nil, context.Cause(ctx)
	}
	b := setup(t, testConfig{heartbeat: 20 * time.Millisecond, handlers: []conveyor.Handler{conveyor.Handle("t.block", handle)}})
	b.store.mu.Lock()
	// Claims still land; every renewal fails, and the database is back
	// well before the test would give up.
	b.store.outage = 3 * b.w.cfg.Lease
	b.store.mu.Unlock()
	id := b.store.add("t.block", 3)
	a := b.deliver(t, id)
	require.ErrorIs(t, receive(t, causes), conveyor.ErrLost)
	require.Equal(t, "lost", b.finished(t, id))
	receive(t, a.done)
	require.Empty(t, b.store.transitions(id), "nothing written for a task whose lease ran out")
	require.Equal(t, task.StatusInProgress, b.store.get(id).Status, "left to the lease reaper")
}

// The task a delivery claims is run by the handler of the task's own type,
// never by the one its message names: a message whose type is not its
// task's does not run the task with the wrong code. The task is handed
// back, its attempt given back, and queued again as its type says.
func TestWorkerRunsNoHandlerOfAnotherTypeThanItsTasks(t *testing.T) {
	var ran atomic.Int32
	handle := func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
		ran.Add(1)
		return "done", nil
	}
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.a", handle)}})
	id := b.store.add("t.b", 3)
	a := newAcker()
	select {
	case b.src.deliveries <- outbox.Delivery{Body: outbox.Body{TaskID: id, Type: "t.a"}, Acknowledger: a}:
	case <-time.After(waitLimit):
		t.Fatal("the worker took no delivery")
	}
	require.Equal(t, "handed_back", b.finished(t, id))
	receive(t, a.done)
	require.Equal(t, "ack", a.how())
	require.Zero(t, ran.Load(), "the handler of another type ran the task")
	got := b.store.get(id)
	require.Equal(t, task.StatusPending, got.Status)
	require.Equal(t, 0, got.Attempt, "the attempt is given back")
	require.Equal(t, []task.Transition{task.HandBack}, b.store.transitions(id))
}

// A handler that keeps reporting is not silent, though the run loop was
// busy (a slow write) when its heartbeat timeout came due: its reports
// came within the timeout, and the one the loop has not taken yet counts
// as much as those it has.
func TestWorkerDoesNotTimeOutAReportingHandlerWhileAWriteWasSlow(t *testing.T) {
	const tasks = 6
	// The lease's renewals come seldom: the clock the run loop finds due
	// after a write is the heartbeat timeout's.
	b := setup(t, testConfig{concurrency: tasks, heartbeat: time.Second, handlers: []conveyor.Handler{
		conveyor.Handle("t.chatty", func(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
			for i := range 80 {
				if err := r.Progress(ctx, i, fmt.Sprintf("Step %d", i)); err != nil {
					return nil, err
				}
				select {
				case <-ctx.Done():
					return nil, context.Cause(ctx)
				case <-time.After(20 * time.Millisecond):
				}
			}
			return "reported all along", nil
		}),
	}})
	ids := make([]uuid.UUID, tasks)
	for i := range ids {
		ids[i] = b.store.add("t.chatty", 1)
	}
	b.store.mu.Lock()
	for _, id := range ids {
		b.store.tasks[id].HeartbeatTimeout = 300 * time.Millisecond
	}
	// Every write outlasts the heartbeat timeout, which comes due while
	// the run loop waits on it.
	b.store.writeTime = 600 * time.Millisecond
	b.store.mu.Unlock()
	for _, id := range ids {
		b.deliver(t, id)
	}
	for _, id := range ids {
		require.Equal(t, "completed", b.finished(t, id),
			"the handler reported every 20 ms; its heartbeat timeout is 300 ms: %s", b.store.get(id).Error)
	}
}

// A handler that panics once stopped (in the code its cancel or its
// timeout runs) has its panic logged with its stack, though the attempt
// ends as the stop says and its stored outcome names no panic.
func TestWorkerLogsAPanicOfAStoppedHandler(t *testing.T) {
	for name, stop := range map[string]func(b *testBundle, id uuid.UUID){
		"cancelled": func(b *testBundle, id uuid.UUID) {
			b.src.cancels <- outbox.Cancel{TaskID: id, Version: b.store.requestCancel(id)}
		},
		"timed out": func(*testBundle, uuid.UUID) {}, // its run time is short
	} {
		t.Run(name, func(t *testing.T) {
			var logs lockedBuffer
			entered := make(chan struct{}, 1)
			b := setup(t, testConfig{log: &logs, maxRunTime: 300 * time.Millisecond, handlers: []conveyor.Handler{
				conveyor.Handle("t.panic", func(ctx context.Context, _ conveyor.Task, _ conveyor.Reporter) (any, error) {
					entered <- struct{}{}
					<-ctx.Done()
					panic("cleanup went wrong")
				}),
			}})
			id := b.store.add("t.panic", 1)
			b.deliver(t, id)
			receive(t, entered)
			stop(b, id)
			require.NotEqual(t, "completed", b.finished(t, id))
			require.Contains(t, logs.String(), "handler panicked")
			require.Contains(t, logs.String(), "cleanup went wrong")
			require.Contains(t, logs.String(), "stack=")
		})
	}
}
