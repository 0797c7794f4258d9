package worker

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/registry"
	"github.com/conveyorhq/conveyor/internal/task"
)

// fakeStore keeps tasks in memory and applies the lifecycle's rules the way
// the PostgreSQL store does (fenced by version, From status and pending
// cancel), so the worker's logic can be tested alone. The real store is
// tested against PostgreSQL in internal/postgres.
type fakeStore struct {
	mu      sync.Mutex
	tasks   map[uuid.UUID]*task.Task
	results map[uuid.UUID]json.RawMessage
	applied []task.Change
	// refuse makes Apply refuse a change for its data, as PostgreSQL does.
	refuse func(task.Change) error
	// loseReply makes Apply write a change and then answer an error, as a
	// commit whose reply is lost does.
	loseReply func(task.Change) bool
	// claimReply, when set, is asked about each claim call: lose makes the
	// call claim and then answer an error (a commit whose reply is lost),
	// fail makes it answer an error having claimed nothing.
	claimReply func(ids []uuid.UUID) (lose, fail bool)
	// afterClaim, when set, runs (under mu) after a claim call's tasks are
	// claimed, before the call answers.
	afterClaim func()
	// typesGate, when set, holds TypesReady until it is closed.
	typesGate chan struct{}
	// writeTime, when set, is how long each ApplyAndClaim takes, as a
	// commit does.
	writeTime time.Duration
	// spawns counts the Spawn calls; spawnTraces holds the trace each
	// was given for its children.
	spawns      atomic.Int32
	spawnTraces []task.Carrier
	// outage, when set, fails every write of changes for that long from
	// the first one it fails, as a database that is down does.
	outage     time.Duration
	outageFrom time.Time
}

func newFakeStore() *fakeStore {
	return &fakeStore{tasks: map[uuid.UUID]*task.Task{}, results: map[uuid.UUID]json.RawMessage{}}
}

func (s *fakeStore) add(typ string, maxAttempts int) uuid.UUID {
	s.mu.Lock()
	defer s.mu.Unlock()
	id := uuid.Must(uuid.NewV7())
	s.tasks[id] = &task.Task{ID: id, Type: typ, Status: task.StatusPending, State: task.StateQueued,
		Version: 1, MaxAttempts: maxAttempts, Payload: json.RawMessage(`{}`), NextRunAt: time.Now()}
	return id
}

// running counts the tasks in progress.
func (s *fakeStore) running() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, t := range s.tasks {
		if t.Status == task.StatusInProgress {
			n++
		}
	}
	return n
}

func (s *fakeStore) get(id uuid.UUID) task.Task {
	s.mu.Lock()
	defer s.mu.Unlock()
	return *s.tasks[id]
}

// requestCancel does what the API does to a running task.
func (s *fakeStore) requestCancel(id uuid.UUID) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.requestCancelLocked(id)
}

// requestCancelLocked is requestCancel under mu.
func (s *fakeStore) requestCancelLocked(id uuid.UUID) int {
	t := s.tasks[id]
	now := time.Now()
	t.CancelRequestedAt, t.State = &now, task.StateCancelRequested
	t.Version++
	return t.Version
}

func (s *fakeStore) ApplyAndClaim(ctx context.Context, changes []task.Change, ids []uuid.UUID, workerID string,
	lease time.Duration) ([]task.Applied, []error, []task.Task, error) {
	// As the database pool's tracer does: a statement is a CLIENT span
	// under the context's span, when that span records.
	if parent := trace.SpanFromContext(ctx); parent.IsRecording() {
		_, span := parent.TracerProvider().Tracer("fake").Start(ctx, statementName(changes, ids),
			trace.WithSpanKind(trace.SpanKindClient))
		defer span.End()
	}
	s.mu.Lock()
	wait := s.writeTime
	if s.outage > 0 && len(changes) > 0 {
		if s.outageFrom.IsZero() {
			s.outageFrom = time.Now()
		}
		if time.Since(s.outageFrom) < s.outage {
			s.mu.Unlock()
			return nil, nil, nil, &task.Error{Code: task.ErrCodeUnavailable, Message: "database unavailable, try again"}
		}
	}
	s.mu.Unlock()
	time.Sleep(wait)
	out, errs, err := s.Apply(ctx, changes)
	if err != nil {
		out, errs = make([]task.Applied, len(changes)), slices.Repeat([]error{err}, len(changes))
	}
	s.mu.Lock()
	reply := s.claimReply
	s.mu.Unlock()
	var lose, fail bool
	if reply != nil && len(ids) > 0 {
		lose, fail = reply(ids)
	}
	if fail {
		return out, errs, nil, errors.New("connection reset before the claim")
	}
	tasks, err := s.Claim(ctx, ids, workerID, lease)
	s.mu.Lock()
	if s.afterClaim != nil && len(tasks) > 0 {
		s.afterClaim()
	}
	s.mu.Unlock()
	if lose {
		return out, errs, nil, errors.New("connection reset after the claim's commit")
	}
	return out, errs, tasks, err
}

// statementName names a batch's statement as the store's do: tasks.claim
// for claims alone, tasks.apply.<transition> for changes of one transition.
func statementName(changes []task.Change, ids []uuid.UUID) string {
	if len(changes) == 0 {
		return "tasks.claim"
	}
	name := "tasks.apply." + string(changes[0].Transition)
	for _, c := range changes[1:] {
		if c.Transition != changes[0].Transition {
			name = "tasks.apply"
		}
	}
	return name
}

func (s *fakeStore) Claim(_ context.Context, ids []uuid.UUID, workerID string, _ time.Duration) ([]task.Task, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []task.Task
	for _, id := range ids {
		t := s.tasks[id]
		if t == nil || t.Status != task.StatusPending {
			continue
		}
		now := time.Now()
		t.Status, t.State, t.Progress, t.WorkerID, t.StartedAt = task.StatusInProgress, task.StateRunning, 0, workerID, &now
		t.Attempt++
		t.Version++
		out = append(out, *t)
	}
	return out, nil
}

func (s *fakeStore) Apply(_ context.Context, changes []task.Change) ([]task.Applied, []error, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out, errs := make([]task.Applied, len(changes)), make([]error, len(changes))
	for i, c := range changes {
		r, err := c.Rule()
		if err != nil {
			return nil, nil, err
		}
		if s.refuse != nil {
			if errs[i] = s.refuse(c); errs[i] != nil {
				continue
			}
		}
		t := s.tasks[c.TaskID]
		if t == nil || t.Version != c.Version || !t.Status.In(r.From) || (r.NeedsCancel && t.CancelRequestedAt == nil) {
			out[i].Fenced = true
			continue
		}
		s.applied = append(s.applied, c)
		t.Status = r.To
		switch {
		case r.State != "":
			t.State = r.State
		case c.State != "":
			t.State = c.State
		}
		switch r.Progress {
		case task.Set:
			t.Progress = max(t.Progress, c.Progress)
		case task.Fill:
			t.Progress = 100
		case task.Clear:
			t.Progress = 0
		}
		switch r.Error {
		case task.Set:
			t.Error = c.Error
		case task.Clear:
			t.Error = ""
		}
		if r.Attempt == task.GiveBack {
			t.Attempt--
		}
		if r.Result {
			s.results[t.ID] = c.Result
		}
		t.Version++
		out[i].Version = t.Version
		if s.loseReply != nil && s.loseReply(c) {
			out[i], errs[i] = task.Applied{}, errors.New("the connection closed before the commit's reply")
		}
	}
	return out, errs, nil
}

func (s *fakeStore) Spawn(_ context.Context, _ task.Task, _ []task.Submission, trace task.Carrier) ([]task.ChildState, error) {
	s.spawns.Add(1)
	s.mu.Lock()
	s.spawnTraces = append(s.spawnTraces, trace)
	s.mu.Unlock()
	return nil, errors.New("the fake store spawns no children")
}

func (s *fakeStore) Inspect(_ context.Context, id uuid.UUID) (task.Hold, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.tasks[id]
	if t == nil {
		return task.Hold{}, task.ErrNotFound
	}
	return task.Hold{Status: t.Status, Version: t.Version, WorkerID: t.WorkerID, Attempt: t.Attempt,
		CancelRequested: t.CancelRequestedAt != nil}, nil
}

func (s *fakeStore) Held(_ context.Context, id uuid.UUID, workerID string, attempt int) (task.Task, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.tasks[id]
	if t == nil || t.Status != task.StatusInProgress || t.WorkerID != workerID || t.Attempt != attempt {
		return task.Task{}, false, nil
	}
	held := *t
	if held.CancelRequestedAt != nil {
		// As the claim left it: the cancel's request moved it one on.
		held.Version--
	}
	return held, true, nil
}

func (s *fakeStore) transitions(id uuid.UUID) []task.Transition {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []task.Transition
	for _, c := range s.applied {
		if c.TaskID == id {
			out = append(out, c.Transition)
		}
	}
	return out
}

func (s *fakeStore) Register(context.Context, registry.Worker) error { return nil }
func (s *fakeStore) Heartbeat(context.Context, string) (bool, error) { return true, nil }
func (s *fakeStore) Leave(context.Context, string) error             { return nil }
func (s *fakeStore) TypesReady(ctx context.Context, _ []string) error {
	s.mu.Lock()
	gate := s.typesGate
	s.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
		}
	}
	return nil
}

// fakeBroker hands out fake sources; the test sends deliveries into the
// current one.
type fakeBroker struct {
	mu      sync.Mutex
	sources []*fakeSource
	made    chan *fakeSource
}

func newFakeBroker() *fakeBroker { return &fakeBroker{made: make(chan *fakeSource, 16)} }

func (b *fakeBroker) Consume(_ context.Context, _ []string, prefetch int) (Source, error) {
	s := &fakeSource{deliveries: make(chan outbox.Delivery), cancels: make(chan outbox.Cancel, 16), done: make(chan struct{})}
	s.prefetch.Store(int32(prefetch))
	b.mu.Lock()
	b.sources = append(b.sources, s)
	b.mu.Unlock()
	b.made <- s
	return s, nil
}

type fakeSource struct {
	prefetch   atomic.Int32
	packed     atomic.Int32 // the packed messages' prefetch
	paused     atomic.Bool  // the packed queues
	deliveries chan outbox.Delivery
	cancels    chan outbox.Cancel
	done       chan struct{}
	once       sync.Once
	err        error
}

func (s *fakeSource) Deliveries() <-chan outbox.Delivery { return s.deliveries }
func (s *fakeSource) Cancels() <-chan outbox.Cancel      { return s.cancels }
func (s *fakeSource) Done() <-chan struct{}              { return s.done }
func (s *fakeSource) Err() error                         { return s.err }
func (s *fakeSource) StopConsuming()                     {}
func (s *fakeSource) SetPrefetch(n int) error            { s.prefetch.Store(int32(n)); return nil }
func (s *fakeSource) SetPackedPrefetch(n int) error      { s.packed.Store(int32(n)); return nil }
func (s *fakeSource) PausePacked() error                 { s.paused.Store(true); return nil }
func (s *fakeSource) ResumePacked() error                { s.paused.Store(false); return nil }
func (s *fakeSource) Close() error                       { s.stop(errors.New("closed")); return nil }
func (s *fakeSource) stop(err error)                     { s.once.Do(func() { s.err = err; close(s.done) }) }

// acker records how a delivery was settled.
type acker struct {
	mu      sync.Mutex
	settled string
	at      time.Time
	done    chan struct{}
}

func newAcker() *acker { return &acker{done: make(chan struct{})} }

func (a *acker) settle(how string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.settled == "" {
		a.settled, a.at = how, time.Now()
		close(a.done)
	}
	return nil
}

func (a *acker) Ack() error     { return a.settle("ack") }
func (a *acker) Requeue() error { return a.settle("requeue") }
func (a *acker) Reject() error  { return a.settle("reject") }

func (a *acker) how() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.settled
}
