package worker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	oteltrace "go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/registry"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/telemetry"
)

// These tests run the worker's real logic against an in-memory store and a
// fake broker, and wait on the worker's test signals rather than on time.

const waitLimit = 10 * time.Second

type testBundle struct {
	store  *fakeStore
	broker *fakeBroker
	w      *Worker
	src    *fakeSource
	cancel context.CancelFunc
	done   chan struct{}
	// outcomes holds finish signals read while waiting for another task,
	// started the start signals.
	outcomes map[uuid.UUID]string
	started  map[uuid.UUID]bool
}

type testConfig struct {
	concurrency int
	maxRunTime  time.Duration
	readAhead   int
	// readAheadMax is Config.ReadAheadMax: 0, the read-ahead stays.
	readAheadMax    int
	tasksPerMessage int
	longAfter       time.Duration
	// progressInterval is Config.ProgressInterval: 0, 10 ms.
	progressInterval time.Duration
	// heartbeat is Config.Heartbeat (0: 100 ms), with a lease ten times
	// as long (0: 2 s).
	heartbeat time.Duration
	handlers  []conveyor.Handler
	// tracerProvider, when set, traces the worker (a no-op tracer
	// otherwise).
	tracerProvider oteltrace.TracerProvider
	// log, when set, gets the worker's log (discarded otherwise).
	log io.Writer
}

// fakeDeps are a worker's collaborators in memory, with no logs, traces
// or metrics anyone reads.
func fakeDeps(store *fakeStore, broker *fakeBroker) Deps {
	return Deps{
		Store: store, Broker: broker, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		TracerProvider: noop.NewTracerProvider(), Propagator: propagation.TraceContext{},
		Metrics: NewMetrics(prometheus.NewRegistry()),
	}
}

func setup(t *testing.T, tc testConfig) *testBundle {
	t.Helper()
	t.Parallel()
	if tc.concurrency == 0 {
		tc.concurrency = 4
	}
	if tc.maxRunTime == 0 {
		tc.maxRunTime = time.Hour
	}
	if tc.longAfter == 0 {
		tc.longAfter = time.Hour
	}
	if tc.progressInterval == 0 {
		tc.progressInterval = 10 * time.Millisecond
	}
	b := &testBundle{store: newFakeStore(), broker: newFakeBroker(), done: make(chan struct{}), outcomes: map[uuid.UUID]string{},
		started: map[uuid.UUID]bool{}}
	deps := fakeDeps(b.store, b.broker)
	if tc.tracerProvider != nil {
		deps.TracerProvider = tc.tracerProvider
	}
	if tc.log != nil {
		deps.Log = telemetry.NewLogger(tc.log, "info", "text")
	}
	lease := 2 * time.Second
	if tc.heartbeat == 0 {
		tc.heartbeat = 100 * time.Millisecond
	} else {
		lease = 10 * tc.heartbeat
	}
	w, err := New(Config{
		Info:        registry.Worker{ID: "w1"},
		Concurrency: tc.concurrency, Lease: lease, Heartbeat: tc.heartbeat,
		ProgressInterval: tc.progressInterval, BackoffBase: time.Millisecond, BackoffMax: 10 * time.Millisecond,
		ShutdownTimeout: time.Second, MaxRunTime: tc.maxRunTime, ReadAhead: tc.readAhead, ReadAheadMax: tc.readAheadMax, TasksPerMessage: tc.tasksPerMessage,
		LongAfter:           tc.longAfter,
		ReconnectBackoffMax: 10 * time.Millisecond,
	}, deps, tc.handlers)
	require.NoError(t, err)
	w.signals = signals{
		connected: make(signal[struct{}], 16), started: make(signal[uuid.UUID], 100),
		dropped: make(signal[uuid.UUID], 100), finished: make(signal[finished], 100),
		prefetch: make(signal[int], 100),
	}
	b.w = w
	ctx, cancel := context.WithCancel(context.Background())
	b.cancel = cancel
	go func() { defer close(b.done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-b.done })
	b.src = receive(t, b.broker.made)
	receive(t, w.signals.connected)
	return b
}

func receive[T any](t *testing.T, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(waitLimit):
		t.Fatalf("no signal within %s", waitLimit)
		panic("unreachable")
	}
}

// deliver sends a delivery of the task to the worker and returns its acker.
func (b *testBundle) deliver(t *testing.T, id uuid.UUID) *acker {
	t.Helper()
	a := newAcker()
	d := outbox.Delivery{Body: outbox.Body{TaskID: id, Type: b.store.get(id).Type}, Acknowledger: a}
	select {
	case b.src.deliveries <- d:
	case <-time.After(waitLimit):
		t.Fatal("the worker took no delivery")
	}
	return a
}

func (b *testBundle) finished(t *testing.T, id uuid.UUID) string {
	t.Helper()
	for {
		if o, ok := b.outcomes[id]; ok {
			delete(b.outcomes, id)
			return o
		}
		f := receive(t, b.w.signals.finished)
		b.outcomes[f.taskID] = f.outcome
	}
}

// blocking is a handler that runs until released or cancelled.
type blocking struct {
	release chan struct{}
	entered chan struct{}
	ignore  bool // ignore the context
}

func newBlocking() *blocking {
	return &blocking{release: make(chan struct{}), entered: make(chan struct{}, 16)}
}

func (h *blocking) handle(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
	h.entered <- struct{}{}
	if h.ignore {
		<-h.release
		return "late", nil
	}
	select {
	case <-h.release:
		return map[string]bool{"ok": true}, nil
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
}

func TestWorkerCompletesATaskAndAcksAfterTheOutcome(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 3)
	a := b.deliver(t, id)
	receive(t, h.entered)
	require.Empty(t, a.how(), "the delivery stays unsettled while its task runs")
	close(h.release)
	require.Equal(t, "completed", b.finished(t, id))
	receive(t, a.done)
	require.Equal(t, "ack", a.how())
	got := b.store.get(id)
	require.Equal(t, task.StatusCompleted, got.Status)
	require.Equal(t, 100, got.Progress)
	require.JSONEq(t, `{"ok":true}`, string(b.store.results[id]))
}

// Without read-ahead, the worker takes a delivery only when a slot is free:
// a message never waits inside a busy worker (and times out there) while
// another worker could run it.
func TestWorkerTakesNoDeliveryWithoutAFreeSlot(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{concurrency: 1, handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	first, second := b.store.add("t.block", 3), b.store.add("t.block", 3)
	b.deliver(t, first)
	receive(t, h.entered)
	d := outbox.Delivery{Body: outbox.Body{TaskID: second, Type: "t.block"}, Acknowledger: newAcker()}
	select {
	case b.src.deliveries <- d:
		t.Fatal("a delivery was taken while every slot was busy")
	default:
	}
	close(h.release)
	require.Equal(t, "completed", b.finished(t, first))
	b.deliver(t, second)
	require.Equal(t, "completed", b.finished(t, second))
}

// A source that stops for any reason — a closed channel, a consumer the
// broker cancelled — is replaced: the worker never stops consuming while
// it looks healthy.
func TestWorkerReconnectsWhenItsSourceStops(t *testing.T) {
	h := newBlocking()
	close(h.release)
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	b.src.stop(errors.New("consumer cancelled by the broker"))
	b.src = receive(t, b.broker.made)
	receive(t, b.w.signals.connected)
	require.True(t, b.w.Ready())
	id := b.store.add("t.block", 3)
	b.deliver(t, id)
	require.Equal(t, "completed", b.finished(t, id))
}

// A cancel broadcast names the version of its request: one that predates
// the current run (a late broadcast of a cancel that was followed by a
// retry) does not stop it; a current one does.
// A cancel broadcast that comes while the task's claim is on its way back
// (the API saw it running, the worker does not list it yet) stops the
// handler as soon as it starts, not at the next lease renewal.
func TestWorkerHonoursACancelThatCameDuringItsClaim(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{heartbeat: time.Minute, handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 3)
	b.store.mu.Lock()
	b.store.afterClaim = func() {
		v := b.store.requestCancelLocked(id) // what the API does, the task now running
		b.src.cancels <- outbox.Cancel{TaskID: id, Version: v}
		time.Sleep(50 * time.Millisecond) // the broadcast is heard before the claim's answer
	}
	b.store.mu.Unlock()
	b.deliver(t, id)
	require.Equal(t, "cancelled", b.finished(t, id))
	require.Equal(t, task.StatusCancelled, b.store.get(id).Status)
}

// slowAck is an acknowledger whose Ack waits until release is closed.
type slowAck struct {
	*acker
	release chan struct{}
}

func (a slowAck) Ack() error {
	<-a.release
	return a.acker.Ack()
}

// A cancel broadcast heard while a task's next attempt is being claimed
// here stops that attempt as its handler starts, also when the previous
// attempt of the task, on this worker, has not left yet (its outcome is
// stored, its delivery not yet settled): the broadcast is the new
// attempt's, not the old one's to ignore.
func TestWorkerHonoursACancelThatCameDuringAClaimBehindAnEarlierAttempt(t *testing.T) {
	entered := make(chan struct{}, 1)
	handler := func(ctx context.Context, tk conveyor.Task, _ conveyor.Reporter) (any, error) {
		if tk.Attempt == 1 {
			return nil, errors.New("boom")
		}
		entered <- struct{}{}
		<-ctx.Done()
		return nil, context.Cause(ctx)
	}
	// No lease renewal comes within the test to tell the worker of the
	// cancel: only the broadcast can.
	b := setup(t, testConfig{heartbeat: time.Minute, handlers: []conveyor.Handler{conveyor.Handle("t.block", handler)}})
	id := b.store.add("t.block", 3)

	first := slowAck{acker: newAcker(), release: make(chan struct{})}
	defer close(first.release)
	select {
	case b.src.deliveries <- outbox.Delivery{Body: outbox.Body{TaskID: id, Type: "t.block"}, Acknowledger: first}:
	case <-time.After(waitLimit):
		t.Fatal("the worker took no delivery")
	}
	require.Equal(t, "retried", b.finished(t, id))

	b.store.mu.Lock()
	b.store.afterClaim = func() {
		v := b.store.requestCancelLocked(id) // what the API does, the task running again
		b.src.cancels <- outbox.Cancel{TaskID: id, Version: v}
		time.Sleep(50 * time.Millisecond) // the broadcast is heard before the claim's answer
	}
	b.store.mu.Unlock()
	b.deliver(t, id)
	require.Equal(t, "cancelled", b.finished(t, id))
	require.Equal(t, task.StatusCancelled, b.store.get(id).Status)
}

func TestWorkerIgnoresACancelOfAnEarlierRun(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 3)
	b.deliver(t, id)
	receive(t, h.entered)
	claimed := b.store.get(id).Version

	b.src.cancels <- outbox.Cancel{TaskID: id, Version: claimed - 1}
	// The stale broadcast stops nothing: the lease is renewed twice after
	// it, the task still running.
	before := len(b.store.transitions(id))
	require.Eventually(t, func() bool { return len(b.store.transitions(id)) >= before+2 }, waitLimit, time.Millisecond)
	require.Equal(t, task.StatusInProgress, b.store.get(id).Status, "a stale cancel stopped the run")
	v := b.store.requestCancel(id) // what the API does
	// The stale broadcast was handled before the current one, which
	// stops the handler: the attempt ends CANCELLED, not earlier.
	b.src.cancels <- outbox.Cancel{TaskID: id, Version: v}
	require.Equal(t, "cancelled", b.finished(t, id))
	require.Equal(t, task.StatusCancelled, b.store.get(id).Status)
}

func TestWorkerStaleCancelAloneDoesNotStopTheRun(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 3)
	b.deliver(t, id)
	receive(t, h.entered)
	b.src.cancels <- outbox.Cancel{TaskID: id, Version: b.store.get(id).Version - 1}
	// Let the worker renew the lease twice: it is still running.
	before := len(b.store.transitions(id))
	require.Eventually(t, func() bool { return len(b.store.transitions(id)) >= before+2 }, waitLimit, time.Millisecond)
	require.Equal(t, task.StatusInProgress, b.store.get(id).Status)
	close(h.release)
	require.Equal(t, "completed", b.finished(t, id))
}

// A handler that ignores its context cannot keep a task forever: past the
// maximum run time the attempt fails as timed out, the lease is no longer
// renewed, and the task is retried.
func TestWorkerTimesOutAHandlerThatIgnoresItsContext(t *testing.T) {
	h := newBlocking()
	h.ignore = true
	b := setup(t, testConfig{maxRunTime: 50 * time.Millisecond, handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 3)
	b.deliver(t, id)
	receive(t, h.entered)
	require.Equal(t, "retried", b.finished(t, id))
	got := b.store.get(id)
	require.Equal(t, task.StatusPending, got.Status)
	require.Contains(t, got.Error, "timed out")
	n := len(b.store.transitions(id))
	close(h.release) // the late handler's result is dropped
	require.Equal(t, n, len(b.store.transitions(id)))
}

// A cancelled handler that ignores its context cannot keep its task
// IN_PROGRESS until the maximum run time (an hour here): like a timed-out
// one, it gets one lease to stop, then the task ends CANCELLED without it,
// its lease no longer renewed.
func TestWorkerCancelsATaskWhoseHandlerIgnoresItsContext(t *testing.T) {
	h := newBlocking()
	h.ignore = true
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	t.Cleanup(func() { close(h.release) })
	id := b.store.add("t.block", 3)
	b.deliver(t, id)
	receive(t, h.entered)
	v := b.store.requestCancel(id) // what the API does
	b.src.cancels <- outbox.Cancel{TaskID: id, Version: v}
	require.Equal(t, "cancelled", b.finished(t, id))
	require.Equal(t, task.StatusCancelled, b.store.get(id).Status)
	n := len(b.store.transitions(id))
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, n, len(b.store.transitions(id)), "no renewal after the outcome")
}

// The attempt of a handler that ignores its context ends when its timeout
// is stored, and so does its CONSUMER span: a span left open until the
// handler returns, if ever, is never exported, and the task's trace shows
// no worker.
func TestWorkerEndsTheSpanOfAHandlerThatIgnoresItsContext(t *testing.T) {
	h := newBlocking()
	h.ignore = true
	rec := tracetest.NewSpanRecorder()
	b := setup(t, testConfig{maxRunTime: 50 * time.Millisecond, handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)},
		tracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))})
	t.Cleanup(func() { close(h.release) })
	id := b.store.add("t.block", 3)
	b.deliver(t, id)
	receive(t, h.entered)
	require.Equal(t, "retried", b.finished(t, id))
	consumerEnded := func() bool {
		for _, s := range rec.Ended() {
			if s.SpanKind() == oteltrace.SpanKindConsumer {
				return true
			}
		}
		return false
	}
	require.Eventually(t, consumerEnded, 2*time.Second, 10*time.Millisecond,
		"the attempt's outcome is stored: its consumer span ends, though the handler still runs")
}

// An attempt that failed is an error in its trace whether or not the task
// has attempts left: the CONSUMER span of an attempt whose handler failed,
// or ran past its run time, and that was retried shows the error, as the
// last attempt's does.
func TestWorkerMarksTheSpanOfAFailedAttemptAsAnError(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	h := newBlocking()
	b := setup(t, testConfig{maxRunTime: 50 * time.Millisecond, handlers: []conveyor.Handler{
		conveyor.Handle("t.fail", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
			return nil, errors.New("boom")
		}),
		conveyor.Handle("t.block", h.handle),
	}, tracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))})
	failing, slow := b.store.add("t.fail", 3), b.store.add("t.block", 3)
	b.deliver(t, failing)
	require.Equal(t, "retried", b.finished(t, failing))
	b.deliver(t, slow)
	require.Equal(t, "retried", b.finished(t, slow))
	for _, id := range []uuid.UUID{failing, slow} {
		var span sdktrace.ReadOnlySpan
		require.Eventually(t, func() bool {
			for _, s := range rec.Ended() {
				for _, a := range s.Attributes() {
					if s.SpanKind() == oteltrace.SpanKindConsumer && a.Key == "conveyor.task_id" && a.Value.AsString() == id.String() {
						span = s
						return true
					}
				}
			}
			return false
		}, waitLimit, 10*time.Millisecond)
		require.Equal(t, codes.Error, span.Status().Code, "the failed attempt of %s is an error", b.store.get(id).Type)
	}
}

// consumerSpan waits for the ended CONSUMER span of the task id.
func consumerSpan(t *testing.T, rec *tracetest.SpanRecorder, id uuid.UUID) sdktrace.ReadOnlySpan {
	t.Helper()
	var span sdktrace.ReadOnlySpan
	require.Eventually(t, func() bool {
		for _, s := range rec.Ended() {
			for _, a := range s.Attributes() {
				if s.SpanKind() == oteltrace.SpanKindConsumer && a.Key == "conveyor.task_id" && a.Value.AsString() == id.String() {
					span = s
					return true
				}
			}
		}
		return false
	}, waitLimit, 10*time.Millisecond)
	return span
}

// A delivery whose claim the worker gives up as it stops (the database
// failing meanwhile) goes back to the queue unrun: its CONSUMER span is an
// error, saying why, not a span that looks like a delivery that went well.
func TestWorkerMarksTheSpanOfAClaimGivenUpAsAnError(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.a", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
		return nil, nil
	})}, tracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))})
	tried := make(chan struct{}, 1)
	b.store.mu.Lock()
	b.store.claimReply = func([]uuid.UUID) (bool, bool) {
		select {
		case tried <- struct{}{}:
		default:
		}
		return false, true
	}
	b.store.mu.Unlock()
	id := b.store.add("t.a", 3)
	a := b.deliver(t, id)
	receive(t, tried)
	b.cancel()
	receive(t, a.done)
	require.Equal(t, "requeue", a.how())
	span := consumerSpan(t, rec, id)
	require.Equal(t, codes.Error, span.Status().Code)
	require.Contains(t, span.Status().Description, "claim abandoned")
}

// A message whose type is not its task's is handed back unrun: its
// CONSUMER span is an error.
func TestWorkerMarksTheSpanOfAMessageOfAnotherTypeAsAnError(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.a", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
		return nil, nil
	})}, tracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))})
	id := b.store.add("t.b", 3)
	select {
	case b.src.deliveries <- outbox.Delivery{Body: outbox.Body{TaskID: id, Type: "t.a"}, Acknowledger: newAcker()}:
	case <-time.After(waitLimit):
		t.Fatal("the worker took no delivery")
	}
	require.Equal(t, "handed_back", b.finished(t, id))
	span := consumerSpan(t, rec, id)
	require.Equal(t, codes.Error, span.Status().Code)
	require.Contains(t, span.Status().Description, "is not the task's")
}

// A lease renewal is not work of the task: the trace of a long task holds
// its claim and its outcome, not one database span per heartbeat (a day's
// task at the default 5 s would carry some 17,000 of them).
func TestWorkerTracesNoSpanPerHeartbeat(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	h := newBlocking()
	b := setup(t, testConfig{heartbeat: 20 * time.Millisecond, handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)},
		tracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))})
	id := b.store.add("t.block", 3)
	b.deliver(t, id)
	receive(t, h.entered)
	require.Eventually(t, func() bool {
		n := 0
		for _, tr := range b.store.transitions(id) {
			if tr == task.Renew {
				n++
			}
		}
		return n >= 5
	}, waitLimit, 10*time.Millisecond)
	close(h.release)
	require.Equal(t, "completed", b.finished(t, id))
	names := map[string]int{}
	require.Eventually(t, func() bool {
		clear(names)
		for _, s := range rec.Ended() {
			if s.SpanKind() == oteltrace.SpanKindClient {
				names[s.Name()]++
			}
		}
		return names["tasks.apply.complete"] > 0
	}, waitLimit, 10*time.Millisecond, "the outcome's statement is traced")
	require.NotZero(t, names["tasks.claim"], "so is the claim's: %v", names)
	require.Zero(t, names["tasks.apply.renew"], "no span per heartbeat: %v", names)
}

// A handler's progress reports are in its trace as span events, one each;
// their writes (up to one per PROGRESS_MIN_INTERVAL for as long as the
// handler reports) add no database span each.
func TestWorkerTracesProgressAsEventsNotWrites(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	const reports = 5
	var store *fakeStore
	progressWrites := func(id uuid.UUID) int {
		n := 0
		for _, tr := range store.transitions(id) {
			if tr == task.Progress {
				n++
			}
		}
		return n
	}
	b := setup(t, testConfig{tracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)),
		handlers: []conveyor.Handler{conveyor.Handle("t.report", func(ctx context.Context, tk conveyor.Task, r conveyor.Reporter) (any, error) {
			for i := 1; i <= reports; i++ {
				if err := r.Progress(ctx, i*10, fmt.Sprintf("step %d", i)); err != nil {
					return nil, err
				}
				// Each report is written before the next is made.
				for deadline := time.Now().Add(waitLimit); progressWrites(tk.ID) < i; time.Sleep(time.Millisecond) {
					if time.Now().After(deadline) {
						return nil, conveyor.Permanent(fmt.Errorf("report %d never written", i))
					}
				}
			}
			return nil, nil
		})}})
	store = b.store
	id := b.store.add("t.report", 1)
	b.deliver(t, id)
	require.Equal(t, "completed", b.finished(t, id))
	require.Equal(t, reports, progressWrites(id))
	var consumer sdktrace.ReadOnlySpan
	names := map[string]int{}
	require.Eventually(t, func() bool {
		clear(names)
		for _, s := range rec.Ended() {
			switch s.SpanKind() {
			case oteltrace.SpanKindConsumer:
				consumer = s
			case oteltrace.SpanKindClient:
				names[s.Name()]++
			}
		}
		return consumer != nil
	}, waitLimit, 10*time.Millisecond)
	events := 0
	for _, e := range consumer.Events() {
		if e.Name == "progress" {
			events++
		}
	}
	require.Equal(t, reports, events, "one progress event per report")
	require.NotZero(t, names["tasks.apply.complete"], "the outcome's write is traced: %v", names)
	require.Zero(t, names["tasks.apply.progress"], "no span per progress write: %v", names)
}

// A CONSUMER span names the attempt its delivery runs, the attempt the
// task, its events and its logs show (and the one the retry's span calls
// next): not the attempt count the message was written at, one less.
func TestWorkerConsumerSpanNamesTheAttemptItRuns(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.fail", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
			return nil, errors.New("boom")
		}),
	}, tracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))})
	id := b.store.add("t.fail", 3)
	for attempt := range 2 {
		// The message of each attempt, as the relay writes it: the
		// task's attempt count when it was queued.
		d := outbox.Delivery{Body: outbox.Body{TaskID: id, Type: "t.fail", Attempt: attempt}, Acknowledger: newAcker()}
		select {
		case b.src.deliveries <- d:
		case <-time.After(waitLimit):
			t.Fatal("the worker took no delivery")
		}
		require.Equal(t, "retried", b.finished(t, id))
		require.Equal(t, attempt+1, b.store.get(id).Attempt)
	}
	var attempts []int64
	require.Eventually(t, func() bool {
		attempts = nil
		for _, s := range rec.Ended() {
			for _, a := range s.Attributes() {
				if s.SpanKind() == oteltrace.SpanKindConsumer && a.Key == "conveyor.attempt" {
					attempts = append(attempts, a.Value.AsInt64())
				}
			}
		}
		return len(attempts) == 2
	}, waitLimit, 10*time.Millisecond)
	// A span ends once its delivery's goroutine returns, after the
	// outcome's signal: the first attempt's may end after the second's.
	require.ElementsMatch(t, []int64{1, 2}, attempts)
}

// A running task's lease is renewed every heartbeat (100 ms here), not
// once, and the renewals stop with the task.
func TestWorkerRenewsTheLeaseEveryHeartbeat(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 3)
	b.deliver(t, id)
	receive(t, h.entered)
	renewals := func() int {
		n := 0
		for _, tr := range b.store.transitions(id) {
			if tr == task.Renew {
				n++
			}
		}
		return n
	}
	require.Eventually(t, func() bool { return renewals() >= 3 }, waitLimit, 10*time.Millisecond)
	close(h.release)
	require.Equal(t, "completed", b.finished(t, id))
	after := renewals()
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, after, renewals(), "no renewal after the outcome")
}

// A renewal that landed though the worker was told it failed (a commit
// whose reply was lost) moves the task one version on: the next renewal is
// fenced, and the worker, finding the task still its own and no cancel
// pending, runs on at that version instead of giving the task up as lost.
func TestWorkerKeepsATaskWhoseWriteLandedUnbeknownToIt(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	var lost atomic.Bool
	b.store.mu.Lock()
	b.store.loseReply = func(c task.Change) bool { return c.Transition == task.Renew && lost.CompareAndSwap(false, true) }
	b.store.mu.Unlock()
	id := b.store.add("t.block", 3)
	b.deliver(t, id)
	receive(t, h.entered)
	require.Eventually(t, func() bool {
		n := 0
		for _, tr := range b.store.transitions(id) {
			if tr == task.Renew {
				n++
			}
		}
		return n >= 3
	}, waitLimit, 10*time.Millisecond, "renewals go on after the lost reply")
	close(h.release)
	require.Equal(t, "completed", b.finished(t, id))
	require.Equal(t, task.StatusCompleted, b.store.get(id).Status)
}

// A claim whose commit landed though its answer was lost is the worker's:
// the next try finds the task running under this worker, its attempt the
// delivery's next, and runs it, instead of dropping the delivery and
// leaving the task to wait out its lease with its attempt spent.
func TestWorkerRunsATaskWhoseClaimLandedUnbeknownToIt(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	var lost atomic.Bool
	b.store.mu.Lock()
	b.store.claimReply = func([]uuid.UUID) (bool, bool) { return lost.CompareAndSwap(false, true), false }
	b.store.mu.Unlock()
	id := b.store.add("t.block", 3)
	a := b.deliver(t, id)
	receive(t, h.entered)
	close(h.release)
	require.Equal(t, "completed", b.finished(t, id))
	receive(t, a.done)
	require.Equal(t, "ack", a.how())
	got := b.store.get(id)
	require.Equal(t, task.StatusCompleted, got.Status)
	require.Equal(t, 1, got.Attempt, "one attempt, run once")
}

// A claim whose answer was lost is adopted also when the task's previous
// attempt, on this worker, has not left yet (its outcome stored, its
// delivery not yet settled): that attempt does not hold the task, and the
// one the claim started would otherwise wait out its lease unrun.
func TestWorkerRunsATaskWhoseClaimLandedUnbeknownToItBehindAnEarlierAttempt(t *testing.T) {
	handler := func(_ context.Context, tk conveyor.Task, _ conveyor.Reporter) (any, error) {
		if tk.Attempt == 1 {
			return nil, errors.New("boom")
		}
		return 1, nil
	}
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.flaky", handler)}})
	id := b.store.add("t.flaky", 3)

	first := slowAck{acker: newAcker(), release: make(chan struct{})}
	defer close(first.release)
	select {
	case b.src.deliveries <- outbox.Delivery{Body: outbox.Body{TaskID: id, Type: "t.flaky"}, Acknowledger: first}:
	case <-time.After(waitLimit):
		t.Fatal("the worker took no delivery")
	}
	require.Equal(t, "retried", b.finished(t, id))

	var lost atomic.Bool
	b.store.mu.Lock()
	b.store.claimReply = func([]uuid.UUID) (bool, bool) { return lost.CompareAndSwap(false, true), false }
	b.store.mu.Unlock()
	// The retry's message, which names the attempt that failed.
	a := newAcker()
	select {
	case b.src.deliveries <- outbox.Delivery{Body: outbox.Body{TaskID: id, Type: "t.flaky", Attempt: 1}, Acknowledger: a}:
	case <-time.After(waitLimit):
		t.Fatal("the worker took no delivery")
	}
	require.Equal(t, "completed", b.finished(t, id))
	got := b.store.get(id)
	require.Equal(t, task.StatusCompleted, got.Status)
	require.Equal(t, 2, got.Attempt)
}

// A claim whose answer was lost, and a cancel the API accepted before the
// worker read the task back: the run it adopts is cancelled (the
// broadcast, heard while the claim was on its way, is this run's), never
// completed.
func TestWorkerHonoursACancelOfATaskWhoseClaimLandedUnbeknownToIt(t *testing.T) {
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.ok", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) { return 1, nil }),
	}})
	var lost atomic.Bool
	id := b.store.add("t.ok", 3)
	b.store.mu.Lock()
	b.store.claimReply = func([]uuid.UUID) (bool, bool) { return lost.CompareAndSwap(false, true), false }
	b.store.afterClaim = func() {
		if !lost.Load() || b.store.tasks[id].CancelRequestedAt != nil {
			return
		}
		v := b.store.requestCancelLocked(id) // what the API does, the task now running
		b.src.cancels <- outbox.Cancel{TaskID: id, Version: v}
	}
	b.store.mu.Unlock()
	b.deliver(t, id)
	require.Equal(t, "cancelled", b.finished(t, id))
	require.Equal(t, task.StatusCancelled, b.store.get(id).Status)
}

// A second delivery of a task this worker runs, whose claim fails, finds
// the task held by this worker at the attempt it would have started; it
// is the running delivery's, and the second is dropped, not run too.
func TestWorkerAdoptsNoTaskItAlreadyRuns(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{concurrency: 2, handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 3)
	b.deliver(t, id)
	receive(t, h.entered)
	var failed atomic.Bool
	b.store.mu.Lock()
	b.store.claimReply = func([]uuid.UUID) (bool, bool) { return false, failed.CompareAndSwap(false, true) }
	b.store.mu.Unlock()
	second := b.deliver(t, id)
	receive(t, second.done)
	require.Equal(t, "ack", second.how(), "the second delivery is dropped")
	require.True(t, failed.Load(), "the second delivery's claim failed once")
	select {
	case <-h.entered:
		t.Fatal("the task ran twice at once")
	case <-time.After(200 * time.Millisecond):
	}
	close(h.release)
	require.Equal(t, "completed", b.finished(t, id))
}

// A handler that honours its context times out as a failed attempt too.
func TestWorkerTimesOutAHandler(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{maxRunTime: 20 * time.Millisecond, handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 1)
	b.deliver(t, id)
	require.Equal(t, "failed", b.finished(t, id))
	require.Contains(t, b.store.get(id).Error, "timed out after 20ms")
}

// An outcome the database cannot store (a result holding NUL) fails its own
// task with the real reason; the tasks completing beside it are not
// affected.
func TestWorkerFailsAnUnstorableResultAlone(t *testing.T) {
	var mu sync.Mutex
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.nul", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
			mu.Lock()
			defer mu.Unlock()
			return map[string]string{"s": "a\x00b"}, nil
		}),
		conveyor.Handle("t.ok", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) { return 1, nil }),
	}})
	bad, good := b.store.add("t.nul", 3), b.store.add("t.ok", 3)
	b.deliver(t, bad)
	b.deliver(t, good)
	require.Equal(t, "failed", b.finished(t, bad))
	require.Equal(t, "completed", b.finished(t, good))
	got := b.store.get(bad)
	require.Equal(t, task.StatusFailed, got.Status, "permanent: the same result cannot be stored on a retry")
	require.Contains(t, got.Error, `\u0000`)
}

// panickyResult is a handler's result whose encoding panics, as a
// MarshalJSON of the handler's own may.
type panickyResult struct{}

func (panickyResult) MarshalJSON() ([]byte, error) { panic("boom in MarshalJSON") }

// A panic in the encoding of a handler's result is the handler's panic: it
// is recovered and counts as an error, and the worker runs on.
func TestWorkerRecoversAPanicInTheResultsEncoding(t *testing.T) {
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.panicky", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
			return panickyResult{}, nil
		}),
		conveyor.Handle("t.ok", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) { return 1, nil }),
	}})
	bad := b.store.add("t.panicky", 1)
	b.deliver(t, bad)
	require.Equal(t, "failed", b.finished(t, bad))
	require.Contains(t, b.store.get(bad).Error, "boom in MarshalJSON")
	good := b.store.add("t.ok", 3)
	b.deliver(t, good)
	require.Equal(t, "completed", b.finished(t, good))
}

// An outcome PostgreSQL refuses for a reason the worker did not foresee
// fails the attempt with PostgreSQL's own reason, instead of leaving the
// task to the lease reaper.
func TestWorkerFailsAnOutcomeTheDatabaseRefuses(t *testing.T) {
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.ok", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) { return 1, nil }),
	}})
	b.store.mu.Lock()
	b.store.refuse = func(c task.Change) error {
		if c.Transition == task.Complete {
			return &task.Error{Code: task.ErrCodeInvalid, Message: "input rejected by the database: boom"}
		}
		return nil
	}
	b.store.mu.Unlock()
	id := b.store.add("t.ok", 3)
	b.deliver(t, id)
	require.Equal(t, "failed", b.finished(t, id))
	require.Contains(t, b.store.get(id).Error, "boom")
}

// A task the store does not give (already running elsewhere, terminal) is
// acknowledged and dropped: that is how duplicate deliveries die.
func TestWorkerDropsADeliveryItCannotClaim(t *testing.T) {
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.ok", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) { return 1, nil }),
	}})
	id := b.store.add("t.ok", 3)
	b.deliver(t, id)
	require.Equal(t, "completed", b.finished(t, id))
	a := b.deliver(t, id)
	require.Equal(t, id, receive(t, b.w.signals.dropped))
	receive(t, a.done)
	require.Equal(t, "ack", a.how())
}

// Progress reports land, rate-limited, and a state too long or not text is
// cleaned before it is stored.
func TestWorkerStoresProgress(t *testing.T) {
	release := make(chan struct{})
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.progress", func(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
			require.Error(t, r.Progress(ctx, 101, "no"))
			require.NoError(t, r.Progress(ctx, 60, strings.Repeat("é", 300)+"\x00"))
			<-release
			return nil, nil
		}),
	}})
	id := b.store.add("t.progress", 3)
	b.deliver(t, id)
	require.Eventually(t, func() bool { return b.store.get(id).Progress == 60 }, waitLimit, time.Millisecond)
	require.LessOrEqual(t, len(b.store.get(id).State), task.MaxStateLen)
	close(release)
	require.Equal(t, "completed", b.finished(t, id))
	b.store.mu.Lock()
	result := b.store.results[id]
	b.store.mu.Unlock()
	require.JSONEq(t, `null`, string(result))
}

// A progress report whose write failed (the database did not answer) is
// not lost with it: it lands while the handler still runs, though the
// handler reports nothing more — its heartbeat included.
func TestWorkerStoresAProgressReportWhoseWriteFailed(t *testing.T) {
	release := make(chan struct{})
	reported := make(chan struct{})
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.progress", func(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
			require.NoError(t, r.Progress(ctx, 50, "Half way"))
			close(reported)
			<-release
			return nil, nil
		}),
	}})
	var failed atomic.Bool
	b.store.mu.Lock()
	b.store.refuse = func(c task.Change) error {
		if c.Transition == task.Progress && failed.CompareAndSwap(false, true) {
			return errors.New("the database did not answer")
		}
		return nil
	}
	b.store.mu.Unlock()
	id := b.store.add("t.progress", 3)
	b.deliver(t, id)
	<-reported
	defer close(release)
	require.Eventually(t, func() bool { return b.store.get(id).Progress == 50 }, waitLimit, 5*time.Millisecond,
		"the report whose write failed never landed while the handler ran")
	require.Equal(t, "Half way", b.store.get(id).State)
}

// The last progress report of an attempt that runs past its run time
// lands, though it was still waiting for its turn (PROGRESS_MIN_INTERVAL)
// when the handler was stopped: the latest value always lands.
func TestWorkerStoresTheLastProgressOfAnAttemptThatTimesOut(t *testing.T) {
	var b *testBundle
	stored := make(chan struct{})
	b = setup(t, testConfig{maxRunTime: 500 * time.Millisecond, progressInterval: time.Hour, handlers: []conveyor.Handler{
		conveyor.Handle("t.progress", func(ctx context.Context, _ conveyor.Task, r conveyor.Reporter) (any, error) {
			require.NoError(t, r.Progress(ctx, 10, "Step 1/10"))
			<-stored // the first report is written; the next waits for its turn
			require.NoError(t, r.Progress(ctx, 80, "Step 8/10"))
			<-ctx.Done()
			return nil, context.Cause(ctx)
		}),
	}})
	id := b.store.add("t.progress", 1)
	b.deliver(t, id)
	require.Eventually(t, func() bool { return b.store.get(id).Progress == 10 }, waitLimit, time.Millisecond)
	close(stored)
	require.Equal(t, "failed", b.finished(t, id))
	got := b.store.get(id)
	require.Contains(t, got.Error, "timed out")
	require.Equal(t, 80, got.Progress, "the last report, accepted before the timeout, was dropped")
}

// While a handler runs long and every slot is taken, the broker gets no
// credit for more (the read-ahead is withdrawn), and a delivery that still
// arrives goes back to the queue, for a worker that can start it: no
// message waits behind a long handler.
func TestWorkerSendsBackWhatItCannotStartBehindALongHandler(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{concurrency: 1, readAhead: 2, longAfter: 20 * time.Millisecond,
		handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	require.EqualValues(t, 3, b.src.prefetch.Load(), "concurrency plus read-ahead")
	long, next := b.store.add("t.block", 3), b.store.add("t.block", 3)
	b.deliver(t, long)
	receive(t, h.entered)
	require.Equal(t, 1, receive(t, b.w.signals.prefetch), "read-ahead withdrawn once the handler runs long")

	a := b.deliver(t, next)
	receive(t, a.done)
	require.Equal(t, "requeue", a.how())

	close(h.release)
	require.Equal(t, "completed", b.finished(t, long))
	require.Equal(t, 3, receive(t, b.w.signals.prefetch), "read-ahead back once no handler runs long")
	b.deliver(t, next)
	require.Equal(t, "completed", b.finished(t, next))
}

// After a reconnect, the tasks still running hold their slots but their
// deliveries are gone with the old connection: the new connection's credit
// leaves them out, and grows back as they end.
func TestWorkerCountsTasksOfAnEarlierConnection(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{concurrency: 2, readAhead: 0, handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 3)
	b.deliver(t, id)
	receive(t, h.entered)
	// The orphan finishes while the new connection is still being set up:
	// its credit is given back all the same.
	gate := make(chan struct{})
	b.store.mu.Lock()
	b.store.typesGate = gate
	b.store.mu.Unlock()
	b.src.stop(errors.New("connection lost"))
	b.src = receive(t, b.broker.made)
	require.EqualValues(t, 1, b.src.prefetch.Load(), "one slot is held by a task of the old connection")
	close(h.release)
	require.Equal(t, "completed", b.finished(t, id))
	close(gate)
	require.Equal(t, 2, receive(t, b.w.signals.prefetch))
	require.EqualValues(t, 2, b.src.prefetch.Load())
}

// claimed waits until the worker has claimed the task.
func (b *testBundle) claimed(t *testing.T, id uuid.UUID) {
	t.Helper()
	for !b.started[id] {
		b.started[receive(t, b.w.signals.started)] = true
	}
}

// The deliveries read ahead are claimed as they arrive, before a slot is
// free for them, and their handlers start as slots free: the window
// (concurrency plus read-ahead) bounds what the worker holds.
func TestWorkerClaimsWhatItReadsAhead(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{concurrency: 1, readAhead: 2, handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	first, second, third := b.store.add("t.block", 3), b.store.add("t.block", 3), b.store.add("t.block", 3)
	b.deliver(t, first)
	receive(t, h.entered)
	acks := []*acker{b.deliver(t, second), b.deliver(t, third)}
	b.claimed(t, second)
	b.claimed(t, third)
	require.Equal(t, task.StatusInProgress, b.store.get(second).Status)
	require.Equal(t, task.StatusInProgress, b.store.get(third).Status)
	require.Never(t, func() bool { return len(h.entered) > 0 }, 50*time.Millisecond, time.Millisecond,
		"a handler started with no slot free")
	d := outbox.Delivery{Body: outbox.Body{TaskID: b.store.add("t.block", 3), Type: "t.block"}, Acknowledger: newAcker()}
	select {
	case b.src.deliveries <- d:
		t.Fatal("a delivery was taken beyond concurrency plus read-ahead")
	case <-time.After(50 * time.Millisecond):
	}
	for _, a := range acks {
		require.Empty(t, a.how(), "a delivery claimed ahead stays unsettled until its outcome is stored")
	}

	close(h.release)
	for _, id := range []uuid.UUID{first, second, third} {
		require.Equal(t, "completed", b.finished(t, id))
	}
	for _, a := range acks {
		receive(t, a.done)
		require.Equal(t, "ack", a.how())
	}
}

// With quick handlers the read-ahead grows to its most, so that the claims
// fill the writes' batches; once the handlers slow down, it falls back to
// its least, so that a task claimed ahead finds its slot well before it
// would be handed back. The window and the packed messages' prefetch
// follow it.
func TestWorkerPacesItsReadAheadWithItsSlots(t *testing.T) {
	var slow atomic.Bool
	handle := func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
		if slow.Load() {
			time.Sleep(150 * time.Millisecond)
		}
		return nil, nil
	}
	b := setup(t, testConfig{concurrency: 2, readAhead: 2, readAheadMax: 8, longAfter: 200 * time.Millisecond,
		tasksPerMessage: 2, handlers: []conveyor.Handler{conveyor.Handle("t.pace", handle)}})
	require.EqualValues(t, 4, b.src.prefetch.Load(), "the least read-ahead to begin with")
	require.Eventually(t, func() bool { return b.src.packed.Load() == 2 }, waitLimit, time.Millisecond,
		"packed messages of two tasks fill a window of 4")
	require.EqualValues(t, 6, b.w.held.Load(), "the window's places above the least read-ahead are held")
	stop, fed := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(fed)
		for {
			d := outbox.Delivery{Body: outbox.Body{TaskID: b.store.add("t.pace", 3), Type: "t.pace"}, Acknowledger: newAcker()}
			select {
			case b.src.deliveries <- d:
			case <-stop:
				return
			}
		}
	}()
	defer func() { close(stop); <-fed }()

	waitPrefetch(t, b, 2+8, "quick handlers: the most read-ahead")
	// The packed prefetch is set from the read-ahead as it was a moment
	// before the single messages' one: when the pace changed it in
	// between, the packed one follows at the next turn of the serve loop.
	require.Eventually(t, func() bool { return b.src.packed.Load() == 5 }, waitLimit, time.Millisecond,
		"packed messages of two tasks fill a window of 10")
	require.Eventually(t, func() bool { return b.w.held.Load() == 0 }, waitLimit, time.Millisecond,
		"every place of the window is given back")
	slow.Store(true)
	// A slot frees every 150 ms: at most 2 in the 100 ms the pace looks
	// back over.
	waitPrefetch(t, b, 2+2, "slow handlers: the least read-ahead again")
	require.Eventually(t, func() bool { return b.src.packed.Load() == 2 }, waitLimit, time.Millisecond,
		"packed messages of two tasks fill a window of 4")
	// The places above it are held as they free.
	require.Eventually(t, func() bool { return b.w.held.Load() == 6 }, waitLimit, time.Millisecond)
}

// waitPrefetch waits until the worker gives its source the prefetch want
// and the source still has it: a signal of want may wait in the buffer from
// a moment the pace dipped (a busy machine frees few slots for a while),
// the prefetch having moved on since.
func waitPrefetch(t *testing.T, b *testBundle, want int, msg string) {
	t.Helper()
	deadline := time.After(waitLimit)
	for {
		select {
		case p := <-b.w.signals.prefetch:
			if p == want && int(b.src.prefetch.Load()) == want {
				return
			}
		case <-deadline:
			t.Fatalf("%s: no prefetch of %d within %s (now %d)", msg, want, waitLimit, b.src.prefetch.Load())
		}
	}
}

func TestAheadForFollowsTheFreedSlotsInWholeSteps(t *testing.T) {
	for _, tc := range []struct{ freed, base, most, want int }{
		{0, 256, 1024, 256},
		{300, 256, 1024, 256},
		{512, 256, 1024, 512},
		{1000, 256, 1024, 768},
		{6000, 256, 1024, 1024},
		{5, 0, 8, 5},
		{50, 0, 8, 8},
	} {
		require.Equal(t, tc.want, aheadFor(tc.freed, tc.base, tc.most), "%+v", tc)
	}
}

// claimedBehindARunningTask starts a worker of one slot and one delivery of
// read-ahead, with first's handler running and second claimed ahead,
// waiting for the slot.
func claimedBehindARunningTask(t *testing.T) (b *testBundle, h *blocking, first, second uuid.UUID) {
	t.Helper()
	h = newBlocking()
	b = setup(t, testConfig{concurrency: 1, readAhead: 1, handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	first, second = b.store.add("t.block", 3), b.store.add("t.block", 3)
	b.deliver(t, first)
	receive(t, h.entered)
	b.deliver(t, second)
	b.claimed(t, second)
	return b, h, first, second
}

// A task claimed ahead can be cancelled while it waits for a slot: its
// handler never runs.
func TestWorkerCancelsATaskClaimedAhead(t *testing.T) {
	b, h, first, second := claimedBehindARunningTask(t)
	b.src.cancels <- outbox.Cancel{TaskID: second, Version: b.store.requestCancel(second)}
	require.Equal(t, "cancelled", b.finished(t, second))
	require.Equal(t, task.StatusCancelled, b.store.get(second).Status)
	require.Empty(t, h.entered, "the cancelled task's handler never ran")
	close(h.release)
	require.Equal(t, "completed", b.finished(t, first))
	// Nor does it run once the slot it waited for is free: the next task
	// takes the slot (and the cancelled one's place in the window), and
	// its handler is the only one to have started since.
	third := b.store.add("t.block", 3)
	b.deliver(t, third)
	require.Equal(t, "completed", b.finished(t, third))
	require.Len(t, h.entered, 1, "a handler ran besides the next task's: the cancelled task's, once the slot freed")
}

// A task claimed ahead that finds every slot still taken after LongAfter is
// handed back, its attempt given back, for a worker that can start it.
func TestWorkerHandsBackATaskClaimedAheadThatFindsNoSlot(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{concurrency: 1, readAhead: 1, longAfter: 100 * time.Millisecond,
		handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	x, y := b.store.add("t.block", 3), b.store.add("t.block", 3)
	// Both arrive before any handler can run long; one takes the slot.
	ax, ay := b.deliver(t, x), b.deliver(t, y)
	receive(t, h.entered)
	f := receive(t, b.w.signals.finished)
	require.Equal(t, "handed_back", f.outcome)
	running, waiting, wa := x, y, ay
	if f.taskID == x {
		running, waiting, wa = y, x, ax
	}
	require.Equal(t, waiting, f.taskID)
	receive(t, wa.done)
	require.Equal(t, "ack", wa.how(), "the hand-back queued the task again; this delivery is settled")
	got := b.store.get(waiting)
	require.Equal(t, task.StatusPending, got.Status)
	require.Equal(t, 0, got.Attempt, "the attempt is given back")
	changes := b.store.transitions(waiting)
	require.Equal(t, task.HandBack, changes[len(changes)-1])
	require.Empty(t, h.entered, "the task handed back never ran here")
	require.Equal(t, task.StatusInProgress, b.store.get(running).Status)
	close(h.release)
	require.Equal(t, "completed", b.finished(t, running))
}

// When the worker stops taking work, a task claimed ahead is handed back
// at once; the running handler gets its grace period.
func TestWorkerHandsBackWhatItClaimedAheadWhenStopping(t *testing.T) {
	b, h, first, second := claimedBehindARunningTask(t)
	b.cancel()
	require.Equal(t, "handed_back", b.finished(t, second))
	require.Equal(t, task.StatusPending, b.store.get(second).Status)
	require.Equal(t, task.StatusInProgress, b.store.get(first).Status, "the running handler is still in its grace period")
	close(h.release)
	require.Equal(t, "completed", b.finished(t, first))
	require.Empty(t, h.entered)
}

// A handler that ends its goroutine instead of returning (runtime.Goexit,
// as testing's FailNow does) fails its attempt, which is retried, and
// frees its slot: the next task runs.
func TestWorkerFailsAnAttemptWhoseHandlerExitsItsGoroutine(t *testing.T) {
	exits := func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
		runtime.Goexit()
		return nil, nil
	}
	b := setup(t, testConfig{concurrency: 1, handlers: []conveyor.Handler{conveyor.Handle("t.exits", exits),
		conveyor.Handle("t.ok", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) { return "ok", nil })}})
	id := b.store.add("t.exits", 1)
	b.deliver(t, id)
	require.Equal(t, "failed", b.finished(t, id))
	got := b.store.get(id)
	require.Equal(t, task.StatusFailed, got.Status)
	require.Contains(t, got.Error, "Goexit")
	next := b.store.add("t.ok", 1)
	b.deliver(t, next)
	require.Equal(t, "completed", b.finished(t, next), "the slot was freed")
}

// A handler that returns its result as the shutdown's grace period ends
// has done its work: its task completes with that result instead of being
// handed back to run again.
func TestWorkerCompletesATaskWhoseHandlerReturnsAResultAsTheGraceEnds(t *testing.T) {
	entered := make(chan struct{}, 1)
	finishing := func(ctx context.Context, _ conveyor.Task, _ conveyor.Reporter) (any, error) {
		entered <- struct{}{}
		<-ctx.Done()
		return map[string]string{"saved": "all"}, nil
	}
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.finishing", finishing)}})
	id := b.store.add("t.finishing", 3)
	b.deliver(t, id)
	receive(t, entered)
	b.cancel()
	require.Equal(t, "completed", b.finished(t, id))
	got := b.store.get(id)
	require.Equal(t, task.StatusCompleted, got.Status)
	require.Equal(t, task.Complete, b.store.transitions(id)[len(b.store.transitions(id))-1])
}

// A handler stopped at the grace period's end that returns its context's
// error hands its task back.
func TestWorkerHandsBackATaskWhoseHandlerStopsAsTheGraceEnds(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 3)
	b.deliver(t, id)
	receive(t, h.entered)
	b.cancel()
	require.Equal(t, "handed_back", b.finished(t, id))
	require.Equal(t, task.StatusPending, b.store.get(id).Status)
}

// deliverPacked sends the task to the worker as one task of a packed
// message and returns its acker.
func (b *testBundle) deliverPacked(t *testing.T, id uuid.UUID) *acker {
	t.Helper()
	a := newAcker()
	d := outbox.Delivery{Body: outbox.Body{TaskID: id, Type: b.store.get(id).Type}, Packed: true, Acknowledger: a}
	select {
	case b.src.deliveries <- d:
	case <-time.After(waitLimit):
		t.Fatal("the worker took no delivery")
	}
	return a
}

// A task of a packed message is acknowledged once claimed, while its
// handler still runs: a message holds credit only for tasks waiting to be
// taken. The packed queues are paused only while every slot runs long, and
// resumed as soon as one does not.
func TestWorkerSettlesPackedTasksOnClaimAndPausesOnlyWhenEverySlotRunsLong(t *testing.T) {
	one, two := newBlocking(), newBlocking()
	b := setup(t, testConfig{concurrency: 2, longAfter: 50 * time.Millisecond, handlers: []conveyor.Handler{
		conveyor.Handle("t.one", one.handle), conveyor.Handle("t.two", two.handle)}})
	first, second := b.store.add("t.one", 3), b.store.add("t.two", 3)

	a := b.deliverPacked(t, first)
	receive(t, one.entered)
	receive(t, a.done)
	require.Equal(t, "ack", a.how(), "settled once claimed, its handler still running")
	require.Never(t, b.src.paused.Load, 200*time.Millisecond, 5*time.Millisecond,
		"paused while a slot was free")

	b.deliverPacked(t, second)
	receive(t, two.entered)
	require.Eventually(t, b.src.paused.Load, waitLimit, 5*time.Millisecond, "not paused with every slot running long")

	close(one.release)
	require.Equal(t, "completed", b.finished(t, first))
	require.Eventually(t, func() bool { return !b.src.paused.Load() }, waitLimit, 5*time.Millisecond,
		"still paused with a slot free")
	close(two.release)
	require.Equal(t, "completed", b.finished(t, second))
}

// A packed task is acknowledged once claimed and frees its place in the
// window once its handler returns, so neither the broker's credit nor the
// window holds the outcomes still to be written: each write must take as
// many outcomes as it claims tasks. With room for fewer, quick tasks
// claimed faster than their outcomes were written piled up without bound
// (a worker of 16 slots on a backlog of 100,000 grew to 46,000 goroutines
// and 1 GiB).
func TestWorkerWritesOutcomesAsFastAsItClaimsTasks(t *testing.T) {
	const tasks = 400
	b := setup(t, testConfig{concurrency: 2, readAhead: 8, handlers: []conveyor.Handler{
		conveyor.Handle("t.quick", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) { return nil, nil })}})
	b.store.mu.Lock()
	b.store.writeTime = 5 * time.Millisecond
	b.store.mu.Unlock()
	window := 2 + 8
	most := 0
	for range tasks {
		b.deliverPacked(t, b.store.add("t.quick", 1))
		most = max(most, b.store.running())
	}
	require.LessOrEqual(t, most, 2*window, "claimed tasks whose outcome waits to be written")
	require.Eventually(t, func() bool { return b.store.running() == 0 }, waitLimit, 5*time.Millisecond)
}

// While a handler runs long and every slot is taken, a task of a packed
// message waits for a place in the window rather than go back (its
// message would come back with its tasks already claimed), and runs once
// a slot frees.
func TestWorkerHoldsAPackedTaskForAPlaceWhileAHandlerRunsLong(t *testing.T) {
	long, a, c := newBlocking(), newBlocking(), newBlocking()
	b := setup(t, testConfig{concurrency: 3, readAhead: 0, longAfter: 300 * time.Millisecond, handlers: []conveyor.Handler{
		conveyor.Handle("t.long", long.handle), conveyor.Handle("t.a", a.handle), conveyor.Handle("t.c", c.handle)}})
	first := b.store.add("t.long", 3)
	b.deliver(t, first)
	receive(t, long.entered)
	require.Eventually(t, func() bool { return b.w.long.Load() == 1 }, waitLimit, 5*time.Millisecond)
	b.deliver(t, b.store.add("t.a", 3))
	b.deliver(t, b.store.add("t.c", 3))
	receive(t, a.entered)
	receive(t, c.entered)
	b.w.pokeCredit() // serve looks again: every slot taken, one running long

	waiting := b.store.add("t.a", 3)
	ack := b.deliverPacked(t, waiting)
	require.Never(t, func() bool { return ack.how() != "" || len(a.entered) > 0 }, 100*time.Millisecond, 5*time.Millisecond,
		"the packed task was settled or started with no place for it")
	close(a.release) // frees a slot and a place
	require.Equal(t, "completed", b.finished(t, waiting))
	require.Equal(t, "ack", ack.how())
	close(c.release)
	close(long.release)
}

// While every slot runs long, a task of a packed message goes back: the
// packed queues are paused, so its message goes to another worker.
func TestWorkerRequeuesAPackedTaskWhileEverySlotRunsLong(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{concurrency: 2, readAhead: 0, longAfter: 50 * time.Millisecond,
		handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	b.deliver(t, b.store.add("t.block", 3))
	b.deliver(t, b.store.add("t.block", 3))
	receive(t, h.entered)
	receive(t, h.entered)
	require.Eventually(t, b.src.paused.Load, waitLimit, 5*time.Millisecond)

	back := b.store.add("t.block", 3)
	ack := b.deliverPacked(t, back)
	receive(t, ack.done)
	require.Equal(t, "requeue", ack.how())
	require.Equal(t, task.StatusPending, b.store.get(back).Status, "never claimed")
	close(h.release)
}

// A stopping worker consumes nothing more: /readyz says so while its
// running handlers still have their grace period to finish.
func TestWorkerIsNotReadyWhileItDrains(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 3)
	b.deliver(t, id)
	receive(t, h.entered)
	require.True(t, b.w.Ready())
	b.cancel()
	// The grace starts once the worker stops consuming: a readiness that
	// went only after the drain would find the task handed back below.
	require.Eventually(t, func() bool { return !b.w.Ready() }, waitLimit, time.Millisecond,
		"ready while draining, though it consumes nothing")
	require.Equal(t, task.StatusInProgress, b.store.get(id).Status, "the handler still has its grace period")
	require.Equal(t, "handed_back", b.finished(t, id))
}

// A cancel the worker learns of only when storing the outcome misses its
// fence (no broadcast, no heartbeat yet) still ends the task CANCELLED, and
// is counted in the cancel latency as one heard of by a broadcast is.
func TestWorkerRecordsTheLatencyOfACancelFoundAsItStoresTheOutcome(t *testing.T) {
	h := newBlocking()
	b := setup(t, testConfig{heartbeat: time.Minute, handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	id := b.store.add("t.block", 3)
	b.deliver(t, id)
	receive(t, h.entered)
	b.store.requestCancel(id) // what the API does; its broadcast is lost
	close(h.release)
	require.Equal(t, "cancelled", b.finished(t, id))
	require.Equal(t, task.StatusCancelled, b.store.get(id).Status)
	var m dto.Metric
	require.NoError(t, b.w.metrics.cancelLatency.Write(&m))
	require.Equal(t, uint64(1), m.GetHistogram().GetSampleCount())
}

// A CONSUMER span names the task's type and org as well as its id, so that
// an org's or a type's attempts can be found in the tracing backend (a
// packed message's routing key is its type's too, but its destination is
// the packed exchange).
func TestWorkerConsumerSpanNamesTheTasksTypeAndOrg(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	b := setup(t, testConfig{handlers: []conveyor.Handler{
		conveyor.Handle("t.ok", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) { return nil, nil }),
	}, tracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))})
	id := b.store.add("t.ok", 1)
	org := uuid.New()
	b.store.mu.Lock()
	b.store.tasks[id].OrgID = org
	b.store.mu.Unlock()
	b.deliver(t, id)
	require.Equal(t, "completed", b.finished(t, id))
	attrs := map[string]string{}
	require.Eventually(t, func() bool {
		for _, s := range rec.Ended() {
			if s.SpanKind() == oteltrace.SpanKindConsumer {
				for _, a := range s.Attributes() {
					attrs[string(a.Key)] = a.Value.String()
				}
				return true
			}
		}
		return false
	}, waitLimit, 10*time.Millisecond)
	require.Equal(t, id.String(), attrs["conveyor.task_id"])
	require.Equal(t, "t.ok", attrs["conveyor.task_type"])
	require.Equal(t, org.String(), attrs["conveyor.org_id"])
}

// The log line of an attempt that fails the task says why, as the one of
// an attempt that is retried does, in the attempt's trace: "task attempt
// ended" with outcome=failed alone sent the reader to the database.
func TestWorkerLogsWhyATaskFailed(t *testing.T) {
	var logs lockedBuffer
	rec := tracetest.NewSpanRecorder()
	b := setup(t, testConfig{log: &logs, tracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)),
		handlers: []conveyor.Handler{
			conveyor.Handle("t.fail", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
				return nil, errors.New("the upstream said no")
			}),
		}})
	id := b.store.add("t.fail", 1)
	b.deliver(t, id)
	require.Equal(t, "failed", b.finished(t, id))
	var line string
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, "the upstream said no") {
			line = l
		}
	}
	require.NotEmpty(t, line, "no log line says why the task failed: %s", logs.String())
	require.Contains(t, line, "task_id="+id.String())
	require.Contains(t, line, "trace_id=")
}
