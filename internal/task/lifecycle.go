package task

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/conveyorhq/conveyor/internal/outbox"
)

// The lifecycle of a task, in one place.
//
//	            submit
//	              │
//	              ▼
//	   ┌──────▶ PENDING ───cancel-pending───▶ CANCELLED ◀─┐
//	   │          │                                        │
//	   │        claim                                  cancelled
//	   │          ▼                                        │
//	   ├─────── IN_PROGRESS ──(request-cancel: stays, ──────┤
//	   │  retry-later,  │      a broadcast tells the worker)
//	   │  hand-back,    ├──complete──▶ COMPLETED
//	   │  await,        │
//	   │  expire-requeue└──fail───────▶ FAILED
//	   │                                  │
//	   └────────────── retry ◀────────────┴── (FAILED or CANCELLED)
//
// Every change after the submission is a Transition applied to a task at the
// version its caller last saw: the store applies it only while the task is
// still at that version and in one of the rule's From statuses, bumps the
// version, and in the same statement appends the event and writes the
// outbox message the rule asks for. A change that misses its fence changed
// nothing; its caller reads the task again and decides anew.
//
// What happens when a running task is cancelled: the API applies
// RequestCancel (the task stays IN_PROGRESS, its state reads "Cancel
// requested", cancel_requested_at is set and a task.cancel message carrying
// the new version is broadcast to every worker). The worker running it stops
// the handler — at once on the broadcast, unless the broadcast names an
// older run than its own; or at its next write, whose fence misses because
// the version moved — and applies HonourCancel, which only lands while a cancel
// is pending. If the worker died meanwhile, the lease reaper applies
// ExpireCancel instead. A task whose cancellation was accepted never
// completes and never runs again, unless retried.
//
// A handler that spawned children and waits for them returns, and the
// worker applies Await: the task goes back to PENDING on hold (state
// "Waiting for children", not admitted, no message) and the settling of its
// last child queues it again, in the child's transaction; its handler then
// runs again and finds the children's results.

// Transition names a change of a task's lifecycle.
type Transition string

// The transitions. Submit and Claim create and take tasks with statements of
// their own (an insert, and a claim that is fenced by claimability rather
// than by version); their rules still say what they write.
const (
	Submit        Transition = "submit"
	Claim         Transition = "claim"
	Progress      Transition = "progress"
	Renew         Transition = "renew"
	Complete      Transition = "complete"
	Fail          Transition = "fail"
	RetryLater    Transition = "retry-later"
	HonourCancel  Transition = "honour-cancel"
	HandBack      Transition = "hand-back"
	Await         Transition = "await"
	ExpireRequeue Transition = "expire-requeue"
	ExpireFail    Transition = "expire-fail"
	ExpireCancel  Transition = "expire-cancel"
	Republish     Transition = "republish"
	CancelPending Transition = "cancel-pending"
	RequestCancel Transition = "request-cancel"
	Retry         Transition = "retry"
)

// Effect says what a transition does to one column: leave it, set it from
// the change, or reset it.
type Effect uint8

// The effects.
const (
	// Keep leaves the column as it is.
	Keep Effect = iota
	// Set takes the value from the change (progress: never below the
	// stored value, so a report cannot move it backwards).
	Set
	// Clear empties the column (error, cancel request) or resets it
	// (attempt, progress: 0).
	Clear
	// Fill sets the column to its end (progress: 100).
	Fill
	// GiveBack returns the attempt a claim counted (attempt only).
	GiveBack
	// Stamp sets the column to now (cancel request only).
	Stamp
)

// Rule is what a transition does, as data. The stores apply it; nothing
// else decides how a task changes.
type Rule struct {
	// From lists the statuses the transition starts from.
	From []Status
	// To is the status after it (equal to From for in-place changes).
	To Status
	// State is the label the task takes; empty means the change's own
	// (Progress) or, when the change has none, the current one.
	State string
	// Actor is who makes the change, recorded on the event.
	Actor Actor
	// Event: the change appends an event to the task's history.
	Event bool
	// Message is the outbox message the change writes, if any: task.run
	// queues the task (at its next_run_at), task.cancel tells the workers.
	Message outbox.Kind
	// Column effects.
	Attempt, Progress, Error, Cancel Effect
	// Delay: next_run_at becomes now plus the change's Delay (every
	// transition to PENDING sets it; zero means now).
	Delay bool
	// Lease: the lease is renewed for the change's Lease. Leaving
	// IN_PROGRESS always clears the lease.
	Lease bool
	// NeedsCancel: the change lands only while a cancel is pending.
	NeedsCancel bool
	// NewTrace: the change's trace context becomes the task's trace.
	NewTrace bool
	// Result: the change stores its Result.
	Result bool
	// Beat: the change is a heartbeat of the handler (a progress report),
	// which a heartbeat timeout waits for.
	Beat bool
	// Hold: the task goes back to PENDING without reaching its queue; it
	// waits, not admitted, until its children have finished.
	Hold bool
}

// Human labels of the steps every task goes through.
const (
	StateQueued          = "Queued"
	StateWaiting         = "Waiting"
	StateRunning         = "Running"
	StateCancelled       = "Cancelled"
	StateCancelRequested = "Cancel requested"
	StateRetryScheduled  = "Retry scheduled"
	StateCompleted       = "Completed"
	StateFailed          = "Failed"
	// StateAwaiting: the task's handler spawned children and waits for
	// them; the last one to finish queues it again (migration 007).
	StateAwaiting = "Waiting for children"
)

var (
	running     = []Status{StatusInProgress}
	pending     = []Status{StatusPending}
	retryable   = []Status{StatusFailed, StatusCancelled}
	nothingYet  = []Status(nil)
	queueRun    = outbox.KindRun
	tellWorkers = outbox.KindCancel
)

// Lifecycle is every transition's rule.
var Lifecycle = map[Transition]Rule{
	Submit: {From: nothingYet, To: StatusPending, State: StateQueued, Actor: ActorAPI, Event: true,
		Message: queueRun, NewTrace: true},
	Claim: {From: []Status{StatusPending, StatusInProgress}, To: StatusInProgress, State: StateRunning,
		Actor: ActorWorker, Event: true, Lease: true, Progress: Clear},

	// The worker, while it holds the task.
	Progress: {From: running, To: StatusInProgress, Actor: ActorWorker, Event: true, Progress: Set, Lease: true,
		Beat: true},
	Renew: {From: running, To: StatusInProgress, Actor: ActorWorker, Lease: true},
	Complete: {From: running, To: StatusCompleted, State: StateCompleted, Actor: ActorWorker, Event: true,
		Progress: Fill, Error: Clear, Result: true},
	Fail: {From: running, To: StatusFailed, State: StateFailed, Actor: ActorWorker, Event: true, Error: Set},
	RetryLater: {From: running, To: StatusPending, State: StateRetryScheduled, Actor: ActorWorker, Event: true,
		Error: Set, Delay: true, Message: queueRun, NewTrace: true},
	HonourCancel: {From: running, To: StatusCancelled, State: StateCancelled, Actor: ActorWorker, Event: true,
		NeedsCancel: true},
	HandBack: {From: running, To: StatusPending, State: StateQueued, Actor: ActorWorker, Event: true,
		Attempt: GiveBack, Delay: true, Message: queueRun},
	Await: {From: running, To: StatusPending, State: StateAwaiting, Actor: ActorWorker, Event: true,
		Attempt: GiveBack, Delay: true, Message: queueRun, Hold: true},

	// Maintenance, for tasks whose worker stopped renewing the lease, and
	// for tasks whose message was lost.
	ExpireRequeue: {From: running, To: StatusPending, State: StateQueued, Actor: ActorSystem, Event: true,
		Error: Set, Delay: true, Message: queueRun},
	ExpireFail:   {From: running, To: StatusFailed, State: StateFailed, Actor: ActorSystem, Event: true, Error: Set},
	ExpireCancel: {From: running, To: StatusCancelled, State: StateCancelled, Actor: ActorSystem, Event: true, NeedsCancel: true},
	Republish:    {From: pending, To: StatusPending, Actor: ActorSystem, Event: true, Delay: true, Message: queueRun},

	// The API, for a client.
	CancelPending: {From: pending, To: StatusCancelled, State: StateCancelled, Actor: ActorAPI, Event: true, Cancel: Stamp},
	RequestCancel: {From: running, To: StatusInProgress, State: StateCancelRequested, Actor: ActorAPI, Event: true,
		Cancel: Stamp, Message: tellWorkers},
	Retry: {From: retryable, To: StatusPending, State: StateQueued, Actor: ActorAPI, Event: true,
		Attempt: Clear, Progress: Clear, Error: Clear, Cancel: Clear, Delay: true, Message: queueRun, NewTrace: true},
}

// Transitions lists the transitions a store applies with its fenced
// statements (all but Submit and Claim), in a stable order.
func Transitions() []Transition {
	return []Transition{Progress, Renew, Complete, Fail, RetryLater, HonourCancel, HandBack, Await,
		ExpireRequeue, ExpireFail, ExpireCancel, Republish, CancelPending, RequestCancel, Retry}
}

// Change asks for one transition of one task, fenced by the version its
// caller last saw. Fields a transition does not use are ignored.
type Change struct {
	TaskID     uuid.UUID
	Version    int
	Transition Transition
	// Progress (0..100) and State, for Progress.
	Progress int
	State    string
	// Error, for transitions that set it.
	Error string
	// Result, for Complete: a JSON value.
	Result json.RawMessage
	// Delay before the task is due again, for transitions to PENDING.
	Delay time.Duration
	// Lease is the length of a renewed lease.
	Lease time.Duration
	// Detail goes on the event.
	Detail map[string]any
	// Trace is the W3C context of the outbox message (and of the task,
	// with NewTrace); empty means the task's own.
	Trace Carrier
	// By is who asked for the change through the API, for its event.
	By *Principal
}

// Rule returns the change's rule.
func (c Change) Rule() (Rule, error) {
	r, ok := Lifecycle[c.Transition]
	if !ok || c.Transition == Submit || c.Transition == Claim {
		return Rule{}, fmt.Errorf("task %s: %q is not a transition a change can apply", c.TaskID, c.Transition)
	}
	return r, nil
}

// Storable makes the change's free text fit the database (valid UTF-8, no
// NUL, bounded) and checks that its result can be stored as JSON. An error
// says why the change itself cannot be stored; the caller then fails the
// attempt with that error instead.
func (c *Change) Storable() error {
	c.Error = CleanText(c.Error, MaxErrorLen)
	c.State = CleanText(c.State, MaxStateLen)
	if c.Transition == Complete {
		return StorableJSON(c.Result)
	}
	return nil
}

// Applied is the outcome of one change: the task's new version, or Fenced
// when the fence missed and nothing changed.
type Applied struct {
	Version int
	Fenced  bool
}

// Lease is a worker's hold on a running task. Every write the worker makes
// while it holds the task is fenced by Version; a write that matches
// nothing means the hold moved on.
type Lease struct {
	TaskID   uuid.UUID
	WorkerID string
	Attempt  int
	Version  int
}

// Hold is what a worker reads back when a fenced write missed: whether the
// task is still its own (with a new version because a cancel was requested)
// or was lost.
type Hold struct {
	Status          Status
	Version         int
	WorkerID        string
	Attempt         int
	CancelRequested bool
}

// Owns reports whether the hold still belongs to lease's worker and attempt.
func (h Hold) Owns(l Lease) bool {
	return h.Status == StatusInProgress && h.WorkerID == l.WorkerID && h.Attempt == l.Attempt
}

// Decisions the lifecycle makes from what a task is.

// OnCancel says what a client's cancel does to a task in status with or
// without a cancel already pending: the transition to apply, none (asked
// before: nothing new to write), or a conflict.
func OnCancel(status Status, cancelPending bool) (Transition, CancelOutcome, error) {
	switch {
	case status == StatusPending:
		return CancelPending, Cancelled, nil
	case status == StatusInProgress && cancelPending:
		return "", CancelRequested, nil
	case status == StatusInProgress:
		return RequestCancel, CancelRequested, nil
	default:
		return "", 0, Errorf(ErrCodeConflict, "task is %s and cannot be cancelled", status)
	}
}

// OnRetry says whether a client may retry a task in status.
func OnRetry(status Status) (Transition, error) {
	if !status.In(Lifecycle[Retry].From) {
		return "", Errorf(ErrCodeConflict, "task is %s; only FAILED or CANCELLED tasks can be retried", status)
	}
	return Retry, nil
}

// OnLeaseExpired says what becomes of a running task whose worker stopped
// renewing its lease: a pending cancel is honoured, a task out of attempts
// fails, the others run again.
func OnLeaseExpired(cancelPending bool, attempt, maxAttempts int) Transition {
	switch {
	case cancelPending:
		return ExpireCancel
	case attempt >= maxAttempts:
		return ExpireFail
	default:
		return ExpireRequeue
	}
}

// OnFailure says what a failed attempt leads to: FAILED when the error is
// permanent or no attempt is left, otherwise another attempt later.
func OnFailure(permanent bool, attempt, maxAttempts int) Transition {
	if permanent || attempt >= maxAttempts {
		return Fail
	}
	return RetryLater
}

// Standing is where a task stands, as the maintenance duties and the API
// read it before they decide on a transition.
type Standing struct {
	ID            uuid.UUID
	Type          string
	Status        Status
	Version       int
	Attempt       int
	MaxAttempts   int
	CancelPending bool
	WorkerID      string
}
