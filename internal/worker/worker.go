// Package worker runs tasks: it consumes the task queues of its handlers,
// claims each task in PostgreSQL, runs its handler under a renewed lease,
// honours cancellation, and stores the outcome with fenced transitions. One
// elected worker at a time also runs maintenance (maintenance.go).
//
// The worker talks to the database and the broker through the small
// interfaces below, so its logic is tested with fakes (worker_test.go) as
// well as end to end with the real binaries (cmd/worker).
package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/registry"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/wait"
)

// Store is the database as a worker needs it.
type Store interface {
	// ApplyAndClaim applies transitions of held tasks, each fenced by its
	// version, and starts an attempt of those of the tasks ids that are
	// claimable, in one transaction. Either list may be empty.
	ApplyAndClaim(ctx context.Context, changes []task.Change, ids []uuid.UUID, workerID string,
		lease time.Duration) ([]task.Applied, []error, []task.Task, error)
	// Inspect reads who holds a task, after a fenced change missed.
	Inspect(ctx context.Context, id uuid.UUID) (task.Hold, error)
	// Held reads a task the worker holds, running the attempt given, as
	// a claim returns it (at the version the claim left, though a cancel
	// was requested since): after a claim reported failed, whose commit
	// may have landed. ok is false when the task is not so held.
	Held(ctx context.Context, id uuid.UUID, workerID string, attempt int) (t task.Task, ok bool, err error)
	// Spawn submits the children of a held task not submitted yet (by
	// key), and returns where all its children stand, by key.
	Spawn(ctx context.Context, parent task.Task, children []task.Submission, trace task.Carrier) ([]task.ChildState, error)
	Registry
}

// Registry is the worker's record in the database.
type Registry interface {
	Register(ctx context.Context, w registry.Worker) error
	Heartbeat(ctx context.Context, id string) (registered bool, err error)
	Leave(ctx context.Context, id string) error
	// TypesReady says the worker's queues exist, which releases the
	// messages parked for want of them.
	TypesReady(ctx context.Context, types []string) error
}

// Broker connects to the message broker.
type Broker interface {
	// Consume declares the queues of types and consumes them with at most
	// prefetch unsettled deliveries (0: none until SetPrefetch raises it),
	// and the cancel broadcasts.
	Consume(ctx context.Context, types []string, prefetch int) (Source, error)
}

// BrokerFunc adapts a function to Broker.
type BrokerFunc func(ctx context.Context, types []string, prefetch int) (Source, error)

// Consume calls f.
func (f BrokerFunc) Consume(ctx context.Context, types []string, prefetch int) (Source, error) {
	return f(ctx, types, prefetch)
}

// Source is one connection's deliveries.
type Source interface {
	Deliveries() <-chan outbox.Delivery
	Cancels() <-chan outbox.Cancel
	// Done is closed when the source stops delivering for any reason (the
	// connection, a channel or a consumer ended); Err says why.
	Done() <-chan struct{}
	Err() error
	// SetPrefetch changes how many deliveries of single messages may be
	// unacknowledged at once; 0 asks for none until it is raised again.
	SetPrefetch(n int) error
	// SetPackedPrefetch changes how many packed messages may be
	// unacknowledged at once (a worker whose read-ahead follows the pace
	// of its slots makes it follow too). PausePacked asks for no more
	// packed messages; ResumePacked asks for them again.
	SetPackedPrefetch(n int) error
	PausePacked() error
	ResumePacked() error
	// StopConsuming asks for no more deliveries; cancels still arrive.
	StopConsuming()
	Close() error
}

// Config tunes a worker.
type Config struct {
	// Info identifies the worker in the registry; Info.ID also marks the
	// tasks it runs.
	Info             registry.Worker
	Concurrency      int
	Lease            time.Duration
	Heartbeat        time.Duration
	ProgressInterval time.Duration
	BackoffBase      time.Duration
	BackoffMax       time.Duration
	ShutdownTimeout  time.Duration
	// MaxRunTime bounds an attempt: past it the handler is stopped and the
	// attempt fails as timed out.
	MaxRunTime time.Duration
	// ReadAhead is how many deliveries beyond the free slots the broker may
	// send ahead while no handler runs longer than LongAfter (tasks of
	// packed messages may take it then too; see prefetch).
	ReadAhead int
	// ReadAheadMax, when above ReadAhead, lets the read-ahead follow the
	// pace of the slots, up to ReadAheadMax (pace); ReadAhead is then
	// the least it falls to. The packed messages' prefetch follows it:
	// the window divided by TasksPerMessage.
	ReadAheadMax        int
	TasksPerMessage     int
	LongAfter           time.Duration
	ReconnectBackoffMax time.Duration
	// WriteFlights is how many of the worker's writes (a batch of outcomes
	// and claims, one commit) may be in flight at once; 0 or 1: one.
	WriteFlights int
	// CreditPerConsumer says that the source's credit is per consumer,
	// fixed when it starts (quorum queues): a single message that arrives
	// while every slot is taken waits for a place in the window instead of
	// going back (see serve).
	CreditPerConsumer bool
}

// writeJoin is how many calls must wait before a write starts beside one
// in flight: under it, they wait for the one in flight to land and go
// together.
const writeJoin = 64

// Worker runs tasks.
type Worker struct {
	cfg        Config
	store      Store
	broker     Broker
	handlers   map[string]conveyor.HandlerFunc
	log        *slog.Logger
	tracer     trace.Tracer
	propagator propagation.TextMapPropagator
	metrics    *Metrics
	signals    signals

	// Claims and transitions made at about the same time share a
	// statement, and the two statements a commit (writes).
	claims  *batcher[uuid.UUID, *task.Task]
	changes *batcher[task.Change, task.Applied]
	writes  *pair[task.Change, task.Applied, uuid.UUID, *task.Task]

	// A delivery holds a place in the window from its arrival until its
	// handler returns, and a slot while its handler runs: the window
	// (concurrency plus read-ahead) lets the deliveries read ahead be
	// claimed with the rest, before a slot is free for them. The channel
	// has room for the most read-ahead; pace holds the places above the
	// read-ahead in force.
	window chan struct{}
	slots  chan struct{}
	// ahead is the read-ahead in force, held the places pace holds;
	// freed counts the slots freed (pace).
	ahead atomic.Int32
	held  atomic.Int32
	freed atomic.Int64
	// packedApplied is the packed messages' prefetch given the live
	// source, -1 when not yet (the consume loop's goroutine only).
	packedApplied int
	inflight      sync.WaitGroup
	mu            sync.Mutex
	running       map[uuid.UUID]*execution
	// claiming counts, by task, the deliveries between the start of their
	// claim and their execution's entry in running (or their drop): a
	// claim reported failed is adopted only when no other delivery of its
	// task is there (under mu).
	claiming map[uuid.UUID]int
	// early holds the newest cancel broadcast heard for a task being
	// claimed here, which running does not list yet or lists under an
	// earlier attempt: the API may see the claim committed before its
	// answer reaches the worker (under mu).
	early map[uuid.UUID]int

	// The credit the broker gets (see prefetch): long counts running
	// handlers past LongAfter; orphans counts running tasks whose
	// delivery came through an earlier source (under mu, with running);
	// credit is poked when either count changes.
	long    atomic.Int32
	orphans atomic.Int32
	// packedHeld counts the deliveries of packed messages taken and not
	// yet done with: their messages hold no credit of the single ones.
	packedHeld atomic.Int32
	credit     chan struct{}
	// stopping is closed when the worker stops taking work; abandon when
	// its drain stops waiting for handlers that ignore ErrShutdown.
	stopping  chan struct{}
	abandon   chan struct{}
	consuming atomic.Bool
	dbOK      atomic.Bool
}

// Deps are a worker's collaborators.
type Deps struct {
	Store          Store
	Broker         Broker
	Log            *slog.Logger
	TracerProvider trace.TracerProvider
	Propagator     propagation.TextMapPropagator
	Metrics        *Metrics
}

// New returns a worker for the given handlers. Info.Types is set from them.
func New(cfg Config, deps Deps, handlers []conveyor.Handler) (*Worker, error) {
	if err := CheckHandlers(handlers); err != nil {
		return nil, err
	}
	w := &Worker{
		cfg: cfg, store: deps.Store, broker: deps.Broker, handlers: map[string]conveyor.HandlerFunc{},
		log: deps.Log, metrics: deps.Metrics, propagator: deps.Propagator,
		tracer:   deps.TracerProvider.Tracer("github.com/conveyorhq/conveyor/internal/worker"),
		window:   make(chan struct{}, cfg.Concurrency+max(cfg.ReadAhead, cfg.ReadAheadMax)),
		slots:    make(chan struct{}, cfg.Concurrency),
		running:  map[uuid.UUID]*execution{},
		claiming: map[uuid.UUID]int{},
		early:    map[uuid.UUID]int{},
		stopping: make(chan struct{}),
		abandon:  make(chan struct{}),
		credit:   make(chan struct{}, 1),
	}
	// The window has room for the largest read-ahead; pace holds the
	// places beyond the one in force, all of them to begin with.
	for range cap(w.window) - cfg.Concurrency - cfg.ReadAhead {
		w.window <- struct{}{}
		w.held.Add(1)
	}
	w.ahead.Store(int32(cfg.ReadAhead))
	w.claims = newBatcher[uuid.UUID, *task.Task](cap(w.window), 0)
	// A write takes as many outcomes as it may claim tasks: a packed task
	// holds neither the broker's credit nor its place in the window while
	// its outcome waits to be written, so with room for fewer, quick tasks
	// would be claimed faster than their outcomes are written, and pile up.
	w.changes = newBatcher[task.Change, task.Applied](cap(w.window), cfg.Lease)
	w.writes = &pair[task.Change, task.Applied, uuid.UUID, *task.Task]{a: w.changes, b: w.claims, timeout: cfg.Lease, flush: w.flush,
		flights: cfg.WriteFlights, join: writeJoin}
	for _, h := range handlers {
		w.handlers[h.Type] = h.Func
	}
	w.cfg.Info.Types = w.Types()
	w.dbOK.Store(true)
	return w, nil
}

// CheckHandlers refuses handlers a worker cannot run: none at all, or
// one New would refuse. A binary calls it before it connects to anything,
// since they are a programming error.
func CheckHandlers(handlers []conveyor.Handler) error {
	if len(handlers) == 0 {
		return errors.New("worker: no handlers")
	}
	seen := make(map[string]bool, len(handlers))
	for _, h := range handlers {
		// A Handler's fields are exported: one built without
		// conveyor.Handle is checked here as Handle would have, since a
		// type the API refuses names a queue no task reaches, and a nil
		// function would fail every task of its type.
		if err := task.ValidateType(h.Type); err != nil {
			return fmt.Errorf("worker: invalid task type %q: %s", h.Type, err.Message)
		}
		if h.Func == nil {
			return fmt.Errorf("worker: nil handler for type %q", h.Type)
		}
		if seen[h.Type] {
			return fmt.Errorf("worker: two handlers for type %q", h.Type)
		}
		seen[h.Type] = true
	}
	return nil
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

// Ready reports whether the worker is consuming and its last heartbeat
// reached the database.
func (w *Worker) Ready() bool { return w.consuming.Load() && w.dbOK.Load() }

// Run consumes and runs tasks until ctx is done, then shuts down: it stops
// taking work, lets running handlers finish within the shutdown timeout,
// then cancels them and hands their tasks back.
func (w *Worker) Run(ctx context.Context) error {
	w.register(ctx)
	// The batchers outlive ctx: running tasks still claim nothing but
	// store their outcomes while the worker drains.
	bctx, stopBatchers := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBatchers()
	go w.writes.run(bctx)
	// Handlers run under their own context: SIGTERM does not cut them
	// short, the end of the grace period does.
	runCtx, stopHandlers := context.WithCancelCause(context.WithoutCancel(ctx))
	defer stopHandlers(nil)
	go w.heartbeat(ctx)
	if w.cfg.ReadAheadMax > w.cfg.ReadAhead && w.cfg.LongAfter > 0 {
		go w.pace(ctx)
	}

	src := w.consume(ctx, runCtx)
	close(w.stopping)
	// It consumes nothing more: not ready while its handlers finish.
	w.consuming.Store(false)
	w.drain(ctx, src, stopHandlers)
	if src != nil {
		_ = src.Close()
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := w.store.Leave(rctx, w.cfg.Info.ID); err != nil {
		w.log.WarnContext(ctx, "leave worker registry", "error", err)
	}
	return nil
}

// How a worker keeps the broker from holding messages behind busy handlers:
// a delivery is acknowledged only once its attempt's outcome is stored, so
// the broker's prefetch counts the running tasks, and the prefetch is
// concurrency plus a read-ahead. The deliveries read ahead are claimed
// with the others, in the same batches, and wait for a slot already
// claimed: a freed slot finds its next task at once, and a busy worker's
// claim batches are not capped by its slots. While any handler runs longer
// than LongAfter the read-ahead is withdrawn, a delivery that arrives when
// every slot is taken goes back to the queue for another worker, and a task
// claimed ahead that finds no slot within LongAfter is handed back: no
// task waits behind a long handler.
// Tasks still running from an earlier connection (whose deliveries that
// connection took back) are subtracted from the credit. The credit may
// come to nothing (every slot held by packed tasks or by tasks of an
// earlier connection, one of them running long): the source then asks for
// no single messages at all, since the least prefetch the broker knows, 1,
// would bring a message only to send it back, and get it straight back, for
// as long as the long handler runs.
//
// Packed messages come through queues of their own, whose prefetch is fixed
// at the window divided by the most tasks a message carries, and a packed
// message is acknowledged once its tasks are claimed (process), so it holds
// credit only while tasks of it wait to be taken: a long task holds none.
// While handlers run long the credit of the single messages leaves out the
// packed tasks held; a packed task that arrives when every slot is taken
// waits for a place in the window instead of going back (its message would
// come back with the tasks of it already claimed), and is handed back if
// no slot frees in time. Only while every slot runs long are the packed
// queues paused, and what they still yield goes back.
func (w *Worker) prefetch() int {
	p := w.cfg.Concurrency + int(w.ahead.Load())
	if w.long.Load() > 0 {
		p = w.cfg.Concurrency - int(w.packedHeld.Load())
	}
	return max(0, p-int(w.orphans.Load()))
}

// paceTicks is how many times in half of LongAfter pace sets the
// read-ahead.
const paceTicks = 5

// pace sets the read-ahead in force, paceTicks times in half of LongAfter,
// to as many tasks as slots freed in the last half of LongAfter
// (aheadFor): at a steady pace a task claimed ahead then waits for its
// slot about half of LongAfter at most, well before it would be handed
// back, while quick handlers get a read-ahead deep enough to keep every
// write's batches full: tasks wait in the window for their claim's
// commit, not for a slot. The broker's credit follows at once; the window
// follows through hold. When quick handlers turn slow, the tasks already
// claimed ahead may wait past LongAfter and be handed back.
func (w *Worker) pace(ctx context.Context) {
	base, most := w.cfg.ReadAhead, w.cfg.ReadAheadMax
	retarget := make(chan struct{}, 1)
	go w.hold(ctx, retarget)
	t := time.NewTicker(max(w.cfg.LongAfter/(2*paceTicks), time.Millisecond))
	defer t.Stop()
	// before is the count of slots freed paceTicks ticks ago, and when (at
	// first, the pace's start). The count is scaled to half of LongAfter:
	// the first ticks look back over less, so a backlog that arrives finds
	// the read-ahead it needs within a tick or two.
	type count struct {
		n  int64
		at time.Time
	}
	var before [paceTicks]count
	for i := range before {
		before[i].at = time.Now()
	}
	half := w.cfg.LongAfter / 2
	for i := 0; ; i = (i + 1) % paceTicks {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := count{w.freed.Load(), time.Now()}
		freed := float64(now.n-before[i].n) * float64(half) / float64(max(now.at.Sub(before[i].at), time.Millisecond))
		before[i] = now
		if ahead := int32(aheadFor(int(freed), base, most)); ahead != w.ahead.Load() {
			w.ahead.Store(ahead)
			w.pokeCredit()
			select {
			case retarget <- struct{}{}:
			default:
			}
		}
	}
}

// hold keeps as many places of the window as the read-ahead in force
// leaves above it, until ctx ends: it gives places back at once, and
// takes them as they free, waiting in turn with the deliveries that wait
// for one (a channel serves its senders in order; a wait given up on
// every tick would lose its turn each time). retarget says the read-ahead
// changed.
func (w *Worker) hold(ctx context.Context, retarget <-chan struct{}) {
	for {
		want := int32(w.cfg.ReadAheadMax) - w.ahead.Load()
		for ; w.held.Load() > want; w.held.Add(-1) {
			<-w.window
		}
		take := w.window
		if w.held.Load() == want {
			take = nil
		}
		select {
		case take <- struct{}{}:
			w.held.Add(1)
		case <-retarget:
		case <-ctx.Done():
			return
		}
	}
}

// aheadFor is the read-ahead for freed slots in half of LongAfter: as
// many, in whole steps of base (so that the broker's credit changes
// seldom), at least base and at most most. Slots that fill at once do not
// raise it (a backlog's first tasks start together), slots that free do:
// each frees for a task claimed ahead.
func aheadFor(freed, base, most int) int {
	step := max(base, 1)
	return min(most, max(base, freed/step*step))
}

// packedPrefetch is the packed messages' prefetch for the read-ahead in
// force, when it follows the pace (else 0: it stays as the source was
// opened with).
func (w *Worker) packedPrefetch() int {
	if w.cfg.ReadAheadMax <= w.cfg.ReadAhead || w.cfg.TasksPerMessage <= 0 {
		return 0
	}
	return PackedPrefetch(w.cfg.Concurrency+int(w.ahead.Load()), w.cfg.TasksPerMessage)
}

// PackedPrefetch is the packed messages' prefetch of a window: as many
// messages of perMessage tasks as fill it.
func PackedPrefetch(window, perMessage int) int {
	return max(1, (window+perMessage-1)/perMessage)
}

// pokeCredit tells the serve loop that the credit may have changed.
func (w *Worker) pokeCredit() {
	select {
	case w.credit <- struct{}{}:
	default:
	}
}

// consumeFailure is the headline of a failed connection. A broker that
// refused a declaration (a queue exists with other arguments) was reached:
// calling it unreachable would send the operator to the network instead of
// the queue's arguments, which the error names. Any other failure's error
// says what failed (the network, the login, the vhost, TLS).
func consumeFailure(err error) string {
	if rabbitmq.Refused(err) {
		return "queue declaration refused by the broker; retrying"
	}
	return "cannot connect to the broker; retrying"
}

// consume takes deliveries until ctx is done, connecting again whenever the
// source stops for any reason. It returns the live source, if any, so the
// shutdown still hears cancel broadcasts while handlers finish.
func (w *Worker) consume(ctx, runCtx context.Context) Source {
	b := wait.Backoff(100*time.Millisecond, w.cfg.ReconnectBackoffMax)
	for ctx.Err() == nil {
		// Connect only with room in the window: the tasks still running
		// hold theirs, and their deliveries are not on the new connection.
		select {
		case w.window <- struct{}{}:
			<-w.window
		case <-ctx.Done():
			return nil
		}
		w.adoptOrphans()
		w.packedApplied = -1
		prefetch := w.prefetch()
		src, err := w.broker.Consume(ctx, w.Types(), prefetch)
		if err != nil {
			retry := b.NextBackOff()
			w.log.WarnContext(ctx, consumeFailure(err), "error", err, "retry_in", retry)
			wait.Sleep(ctx, retry)
			continue
		}
		b.Reset()
		// A new source consumes its packed queues: pause them at once if
		// every slot runs long.
		w.pokeCredit()
		if err := w.store.TypesReady(ctx, w.Types()); err != nil {
			// Maintenance releases parked messages too; only latency is lost.
			w.log.WarnContext(ctx, "release parked messages", "error", err)
		}
		go w.listenCancels(src)
		w.consuming.Store(true)
		w.signals.connected.send(struct{}{})
		w.log.InfoContext(ctx, "consuming", "types", w.Types(), "concurrency", w.cfg.Concurrency)
		if w.serve(ctx, runCtx, src, prefetch) {
			return src
		}
		w.consuming.Store(false)
		w.log.WarnContext(ctx, "consumer stopped; reconnecting", "error", src.Err())
		_ = src.Close()
	}
	return nil
}

// serve dispatches the deliveries of one source. A delivery is taken once
// the window has room for it; while a handler runs long and every slot is
// taken, a delivery that arrives goes back to the queue, unless it is a
// task of a packed message and not every slot runs long: that one waits
// for a place in the window, and the deliveries behind it with it, for at
// most about LongAfter (see prefetch). It
// returns true when ctx ended (the source is still open) and false when the
// source stopped. applied is the prefetch the source was opened with: the
// credit may have changed since (an orphan finished), and the first poke
// must set it.
func (w *Worker) serve(ctx, runCtx context.Context, src Source, applied int) bool {
	for {
		take, bounce, freed := w.window, (<-chan outbox.Delivery)(nil), (chan struct{})(nil)
		if w.long.Load() > 0 && len(w.slots) == cap(w.slots) {
			// Take nothing until a slot frees (the probe of freed).
			take, bounce, freed = nil, src.Deliveries(), w.slots
		}
		select {
		case <-ctx.Done():
			src.StopConsuming()
			return true
		case <-src.Done():
			return false
		case <-w.credit:
			applied = w.setPrefetch(ctx, src, applied)
			continue
		case d := <-bounce:
			if d.Packed && !w.allLong() && w.placePacked(ctx, src, &applied) {
				w.dispatch(runCtx, d)
				continue
			}
			if !d.Packed && w.cfg.CreditPerConsumer && w.placeHeld(ctx, src, &applied) {
				w.dispatch(runCtx, d)
				continue
			}
			_ = d.Requeue()
			w.metrics.dropped.WithLabelValues("requeued_behind_long_tasks").Inc()
			continue
		case freed <- struct{}{}:
			<-freed
			continue
		case take <- struct{}{}:
		}
		select {
		case <-ctx.Done():
			<-w.window
			src.StopConsuming()
			return true
		case <-src.Done():
			<-w.window
			return false
		case <-w.credit:
			<-w.window
			applied = w.setPrefetch(ctx, src, applied)
		case d := <-src.Deliveries():
			w.dispatch(runCtx, d)
		}
	}
}

// dispatch processes a delivery that holds a place in the window.
func (w *Worker) dispatch(ctx context.Context, d outbox.Delivery) {
	w.inflight.Add(1)
	if d.Packed && w.packedHeld.Add(1) > 0 && w.long.Load() > 0 {
		w.pokeCredit()
	}
	go func() {
		// The delivery's place in the window is freed as soon as its
		// handler returns: storing the outcome and settling the delivery
		// go on beside the next task, within the broker's prefetch.
		release := sync.OnceFunc(func() { <-w.window })
		defer func() {
			release()
			if d.Packed && w.packedHeld.Add(-1) >= 0 && w.long.Load() > 0 {
				w.pokeCredit()
			}
			w.inflight.Done()
		}()
		w.process(ctx, d, release)
	}()
}

// allLong reports whether every slot runs a long handler.
func (w *Worker) allLong() bool {
	return int(w.long.Load()) >= w.cfg.Concurrency
}

// placePacked waits for a place in the window for a packed task that came
// while every slot was taken. It gives up, and the task goes back, when
// every slot comes to run long or the source or ctx ends.
func (w *Worker) placePacked(ctx context.Context, src Source, applied *int) bool {
	for {
		select {
		case w.window <- struct{}{}:
			return true
		case <-w.credit:
			*applied = w.setPrefetch(ctx, src, *applied)
			if w.allLong() {
				return false
			}
		case <-src.Done():
			return false
		case <-ctx.Done():
			return false
		}
	}
}

// placeHeld waits for a place in the window for a single message that
// came while every slot was taken, from a source whose credit is per
// consumer: each type's consumer of a quorum queue has the whole prefetch,
// and keeps its credit while the tasks of other types hold the slots. Sent
// back, the message would come straight back, over and over for as long
// as the long handlers run (thousands of times in a test of 4-second
// tasks): it waits in the worker instead, as docs/quorum.md says. It gives
// up, and the message goes back, only when the source or ctx ends.
func (w *Worker) placeHeld(ctx context.Context, src Source, applied *int) bool {
	for {
		select {
		case w.window <- struct{}{}:
			return true
		case <-w.credit:
			*applied = w.setPrefetch(ctx, src, *applied)
		case <-src.Done():
			return false
		case <-ctx.Done():
			return false
		}
	}
}

// adoptOrphans marks the tasks running now as orphans: the source their
// deliveries came through is gone. Tasks of packed messages are not: they
// never held the single messages' credit, and packedHeld counts them.
func (w *Worker) adoptOrphans() {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, e := range w.running {
		if !e.delivery.Packed {
			e.orphan = true
			n++
		}
	}
	w.orphans.Store(int32(n))
}

// setPrefetch gives the broker the credit the worker can take now, and
// pauses the packed messages while every slot runs long.
func (w *Worker) setPrefetch(ctx context.Context, src Source, applied int) int {
	pause := src.ResumePacked
	if w.allLong() {
		pause = src.PausePacked
	}
	if err := pause(); err != nil {
		w.log.WarnContext(ctx, "pause or resume packed messages", "error", err)
	}
	if n := w.packedPrefetch(); n > 0 && n != w.packedApplied {
		if err := src.SetPackedPrefetch(n); err != nil {
			w.log.WarnContext(ctx, "set packed prefetch", "prefetch", n, "error", err)
		} else {
			w.packedApplied = n
		}
	}
	p := w.prefetch()
	if p == applied {
		return applied
	}
	if err := src.SetPrefetch(p); err != nil {
		w.log.WarnContext(ctx, "set prefetch", "prefetch", p, "error", err)
		return applied
	}
	w.signals.prefetch.send(p)
	return p
}

// drain waits for running handlers, giving back messages that still
// arrive, up to the shutdown timeout; then it stops the handlers, whose
// tasks are handed back. Cancel broadcasts are still honoured meanwhile.
func (w *Worker) drain(ctx context.Context, src Source, stopHandlers context.CancelCauseFunc) {
	done := make(chan struct{})
	go func() { w.inflight.Wait(); close(done) }()
	var deliveries <-chan outbox.Delivery
	if src != nil {
		deliveries = src.Deliveries()
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
			// A handler told to stop gets a heartbeat to return: the
			// process's own stop (a container's grace period, set just
			// above SHUTDOWN_TIMEOUT) must not cut the hand-back short.
			select {
			case <-done:
				return
			case <-time.After(w.cfg.Heartbeat):
			}
			// Left to their leases, their attempts would be spent, and a
			// task on its last attempt would fail for a restart: they are
			// handed back without their handlers, as the grace promised.
			w.log.ErrorContext(ctx, "handlers ignored their context; handing their tasks back without them", "running", w.runningCount())
			close(w.abandon)
			select {
			case <-done:
			case <-time.After(w.cfg.Lease):
				w.log.ErrorContext(ctx, "tasks could not be handed back; their leases will expire", "running", w.runningCount())
			}
			return
		}
	}
}

// listenCancels passes the cancel broadcasts of a source to the executions
// they concern, until the source stops.
func (w *Worker) listenCancels(src Source) {
	for {
		select {
		case <-src.Done():
			return
		case c := <-src.Cancels():
			w.mu.Lock()
			e := w.running[c.TaskID]
			// The task may be listed still under its previous attempt
			// here (its outcome stored, its delivery not yet settled)
			// while its next one is being claimed: that one keeps the
			// broadcast as well, and ignores it if it is of an earlier run.
			if w.claiming[c.TaskID] > 0 {
				w.early[c.TaskID] = max(w.early[c.TaskID], c.Version)
			}
			w.mu.Unlock()
			if e != nil {
				e.requestCancel(c.Version)
			}
		}
	}
}

func (w *Worker) runningCount() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.running)
}

// process claims the task of a delivery and runs it. The delivery is
// acknowledged when the attempt's outcome is stored (a packed task's when
// it is claimed), or at once when the task is not claimable; it is given
// back when the claim could not be made. release frees the delivery's place in the window; it is called
// once the handler has returned.
func (w *Worker) process(ctx context.Context, d outbox.Delivery, release func()) {
	if d.Err != nil {
		w.log.ErrorContext(ctx, "dropping unreadable message", "queue", d.Queue, "message_id", d.MessageID, "error", d.Err)
		w.metrics.dropped.WithLabelValues("unreadable").Inc()
		_ = d.Reject()
		return
	}
	handler := w.handlers[d.Body.Type]
	if handler == nil {
		w.log.ErrorContext(ctx, "no handler for message type; rejected", "type", d.Body.Type, "queue", d.Queue)
		w.metrics.dropped.WithLabelValues("unknown_type").Inc()
		_ = d.Reject()
		return
	}
	ctx, span := w.startConsumerSpan(ctx, d)
	defer span.End()
	log := taskLog{l: w.log, attrs: []any{"task_id", d.Body.TaskID, "type", d.Body.Type}}

	w.mu.Lock()
	w.claiming[d.Body.TaskID]++
	w.mu.Unlock()
	t, sent, err := w.claim(ctx, d)
	if t == nil {
		w.mu.Lock()
		w.claimDone(d.Body.TaskID)
		w.mu.Unlock()
	}
	if err != nil {
		log.WarnContext(ctx, "claim abandoned; message requeued", "error", err)
		span.RecordError(err)
		span.SetStatus(codes.Error, "claim abandoned: "+err.Error())
		_ = d.Requeue()
		return
	}
	// From here the database, not the broker, holds the task: the
	// delivery is acknowledged whatever happens next. A task of a packed
	// message is acknowledged now: the message's credit is for tasks
	// waiting to be claimed, not for running ones (see prefetch).
	if t == nil || d.Packed {
		_ = d.Ack()
	}
	if t != nil {
		nameOrg(span, t)
	}
	if t == nil {
		log.DebugContext(ctx, "delivery dropped: task not claimable (terminal, running, or not due)")
		w.metrics.dropped.WithLabelValues("not_claimable").Inc()
		span.AddEvent("dropped: task not claimable")
		w.signals.dropped.send(d.Body.TaskID)
		return
	}
	if t.Type != d.Body.Type {
		// The message named another type than its task's: its handler
		// is not the task's code. The task goes back to its own queue
		// (the hand-back's message is made from the task), its attempt
		// given back.
		w.mu.Lock()
		w.claimDone(t.ID)
		w.mu.Unlock()
		log.ErrorContext(ctx, "message type is not its task's; task handed back unrun", "task_type", t.Type)
		w.metrics.dropped.WithLabelValues("type_mismatch").Inc()
		span.AddEvent("handed back: message type is not the task's")
		span.SetStatus(codes.Error, "handed back: message type "+d.Body.Type+" is not the task's ("+t.Type+")")
		e := w.newExecution(*t, nil, log.with("attempt", t.Attempt), span, d, sent)
		e.handBackUnrun(ctx, "message type "+d.Body.Type+" is not the task's")
		return
	}
	e := w.newExecution(*t, handler, log.with("attempt", t.Attempt), span, d, sent)
	e.release = release
	w.mu.Lock()
	w.running[e.task.ID] = e
	early := w.early[e.task.ID]
	w.claimDone(e.task.ID)
	w.mu.Unlock()
	if early > 0 {
		// The run loop ignores it if it is of an earlier run.
		e.requestCancel(early)
	}
	defer func() {
		w.mu.Lock()
		// A handler that ignored its context may return after the
		// task's next attempt started here: that entry is the next's.
		if w.running[e.task.ID] == e {
			delete(w.running, e.task.ID)
		}
		orphan := e.orphan
		if orphan {
			w.orphans.Add(-1)
		}
		w.mu.Unlock()
		if orphan {
			w.pokeCredit()
		}
	}()
	e.run(ctx)
}

// claimOnce claims the task of d, adopting it first, after a failed try,
// if that try's claim landed. sent is when the last claim was sent: an
// adopted task's is the try before, which is the one that landed.
func (w *Worker) claimOnce(ctx context.Context, d outbox.Delivery, failed bool, sent *time.Time) (*task.Task, error) {
	if failed {
		t, settled, err := w.adopt(ctx, d)
		if err != nil || settled {
			return t, err
		}
	}
	*sent = time.Now()
	return w.claims.do(ctx, d.Body.TaskID)
}

// adopt reads whether a claim of d reported failed had landed. settled
// says the read decided the delivery: the task is this worker's to run (t),
// or another delivery of it here is being claimed or run (t nil).
func (w *Worker) adopt(ctx context.Context, d outbox.Delivery) (t *task.Task, settled bool, err error) {
	// A connection that hangs must not hold the delivery (nor a stopping
	// worker's drain) longer than a lease.
	hctx, cancel := context.WithTimeout(ctx, w.cfg.Lease)
	held, ok, err := w.store.Held(hctx, d.Body.TaskID, w.cfg.Info.ID, d.Body.Attempt+1)
	cancel()
	if err != nil || !ok {
		return nil, false, err
	}
	// The task may be listed still under its previous attempt here (its
	// outcome stored, its delivery not yet settled): that one does not
	// hold it.
	w.mu.Lock()
	e := w.running[held.ID]
	alone := w.claiming[held.ID] == 1 && (e == nil || e.task.Attempt != held.Attempt)
	w.mu.Unlock()
	if !alone {
		return nil, true, nil
	}
	w.log.InfoContext(ctx, "a claim reported failed had landed; the task is ours", "task_id", held.ID,
		"attempt", held.Attempt)
	return &held, true, nil
}

// claimDone ends a delivery's claim in claiming (under mu).
func (w *Worker) claimDone(id uuid.UUID) {
	if w.claiming[id]--; w.claiming[id] <= 0 {
		delete(w.claiming, id)
		delete(w.early, id)
	}
}

// claim retries a claim that fails on a database error until it succeeds or
// the worker stops taking work. It answers nil when the task is not
// claimable, and when the claim that took the task was sent: its lease
// runs from no earlier than that, on this worker's clock.
//
// A claim reported failed may have landed (a commit whose reply was lost):
// the task is then this worker's, running the delivery's next attempt,
// and claiming it again finds it not claimable. Before each try after a
// failure, such a task is adopted and run, unless another delivery of it
// is being claimed or run here (whose claim may be the one that landed).
// Otherwise it would wait out its lease, its attempt spent unrun.
func (w *Worker) claim(ctx context.Context, d outbox.Delivery) (*task.Task, time.Time, error) {
	b := wait.Backoff(100*time.Millisecond, w.cfg.ReconnectBackoffMax)
	failed := false
	var sent time.Time
	for {
		t, err := w.claimOnce(ctx, d, failed, &sent)
		if err == nil {
			return t, sent, nil
		}
		failed = true
		retry := b.NextBackOff()
		w.log.WarnContext(ctx, "claim failed; retrying", "task_id", d.Body.TaskID, "error", err, "retry_in", retry)
		select {
		case <-w.stopping:
			// The last try's claim may have landed: the task is then
			// run, which hands it back at once with its attempt, rather
			// than held by a stopped worker until its lease expires.
			if t, settled, aerr := w.adopt(ctx, d); aerr == nil && settled {
				return t, sent, nil
			}
			return nil, sent, err
		case <-time.After(retry):
		}
	}
}

// flush applies a batch of transitions and claims the tasks of a batch of
// deliveries, in one round trip and one commit. Each transition is fenced
// by its own version and fails alone. A claimed task is answered as a
// pointer into the batch's tasks, which its execution copies: a task is
// copied once on its way from the rows to its handler. When two
// deliveries of one task share a batch, only the first gets it.
func (w *Worker) flush(ctx context.Context, changes []task.Change, ids []uuid.UUID) ([]task.Applied, []error, []*task.Task, []error) {
	if len(changes) > 0 {
		w.metrics.batchSize.WithLabelValues("apply").Observe(float64(len(changes)))
	}
	if len(ids) > 0 {
		w.metrics.batchSize.WithLabelValues("claim").Observe(float64(len(ids)))
	}
	out, errs, tasks, err := w.store.ApplyAndClaim(ctx, changes, ids, w.cfg.Info.ID, w.cfg.Lease)
	res, claimErrs := make([]*task.Task, len(ids)), make([]error, len(ids))
	if err != nil {
		// The whole call failed: every call in it fails with its error.
		out, errs = make([]task.Applied, len(changes)), slices.Repeat([]error{err}, len(changes))
		return out, errs, res, slices.Repeat([]error{err}, len(ids))
	}
	byID := make(map[uuid.UUID]int, len(tasks))
	for i, t := range tasks {
		byID[t.ID] = i
	}
	for i, id := range ids {
		if j, ok := byID[id]; ok {
			res[i] = &tasks[j]
			delete(byID, id)
		}
	}
	return out, errs, res, claimErrs
}

// register adds the worker to the registry, retrying until the database
// answers or ctx ends.
func (w *Worker) register(ctx context.Context) {
	b := wait.Backoff(100*time.Millisecond, w.cfg.ReconnectBackoffMax)
	for ctx.Err() == nil {
		err := w.store.Register(ctx, w.cfg.Info)
		w.dbOK.Store(err == nil)
		if err == nil {
			return
		}
		retry := b.NextBackOff()
		w.log.WarnContext(ctx, "register worker; retrying", "error", err, "retry_in", retry)
		wait.Sleep(ctx, retry)
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
		registered, err := w.store.Heartbeat(ctx, w.cfg.Info.ID)
		w.dbOK.Store(err == nil)
		switch {
		case err != nil:
			w.log.WarnContext(ctx, "worker heartbeat", "error", err)
		case !registered:
			w.register(ctx)
		}
	}
}
