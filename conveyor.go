// Package conveyor is the public handler API of Conveyor: write a Handler
// for each task type you run, then build your own worker binary with
// worker.Main (package github.com/conveyorhq/conveyor/worker).
//
// A handler gets a context, the task and a Reporter. It returns a result
// (any value that encodes to a JSON object or value, kept small: a pointer to
// large artefacts, never the artefact; a result over 1 MiB as PostgreSQL
// stores it fails the task) or an error. An error is retried with
// backoff until the task's max_attempts are spent, unless it is marked
// Permanent. A panic is recovered and treated as an error.
//
// The context is cancelled when the task is cancelled through the API
// (ErrCancelled), when the worker loses the task (ErrLost: its lease
// expired and the attempt was ended, or the worker could not renew it),
// when the attempt runs past its task's timeout or the worker's maximum
// run time, or its handler reports no progress for the task's heartbeat
// timeout (ErrTimeout), and when the worker shuts down past its grace
// period (ErrShutdown); context.Cause tells which. A handler must return
// soon after its context is done; whatever it returns then is ignored,
// except after ErrShutdown: a result with no error then completes the task.
//
// Delivery is at least once: a handler may run again for the same task after
// a crash, so its effects should be idempotent (the task id is a good key).
package conveyor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/google/uuid"

	"github.com/conveyorhq/conveyor/internal/task"
)

// Task is what a handler knows of the task it runs.
type Task struct {
	ID   uuid.UUID
	Type string
	// Payload is the JSON object the client submitted.
	Payload json.RawMessage
	// Metadata is the client's free-form JSON object.
	Metadata json.RawMessage
	// Attempt counts from 1; MaxAttempts is the task's limit.
	Attempt     int
	MaxAttempts int
	// Run and Node are set when the task is a node of a workflow run:
	// Params are the run's params, Parents the results of the node's
	// parents by node name (null for a parent that completed without one).
	Run     uuid.UUID
	Node    string
	Params  json.RawMessage
	Parents map[string]json.RawMessage
	// Parent is the task that spawned this one with Gather, if any.
	Parent uuid.UUID
}

// Reporter records a running task's progress. Reports are durable (stored in
// PostgreSQL with an event each) and rate-limited: a handler may report as
// often as it likes, the latest value always lands. A Reporter serves its
// handler while it runs: once the handler has returned, its methods (called
// from a goroutine the handler left behind) record nothing and return an
// error.
type Reporter interface {
	// Progress sets the percentage done (0 to 100) and a human label of the
	// current step, such as "Resizing 3/10". The percentage never goes
	// down within an attempt: a report lower than an earlier one keeps the
	// higher percentage, with its own label. It returns the cause of the
	// handler's context once that is done (the task cancelled or lost, the
	// attempt timed out, the worker shutting down), and an error for a
	// percentage out of range. Each report is also a heartbeat: a task
	// with a heartbeat timeout fails when its handler reports nothing for
	// that long.
	Progress(ctx context.Context, percent int, state string) error
	// Gather spawns the children not spawned yet (a child is known by its
	// key: the same key again is the same child) and, once every child
	// has finished, returns their outcomes in the order given. While some
	// still run it returns an error wrapping ErrAwaitChildren: return it
	// from the handler as it is. The task then waits without holding a
	// worker slot or using an attempt, and its handler runs again from the
	// start when the last child has finished; calling Gather with the same
	// children then returns their outcomes. Children that are still
	// running when the parent is cancelled or fails are cancelled.
	// Children it refuses (a bad key, a type or payload the API would
	// refuse, more than MaxGatherChildren or payloads of more than 16 MiB
	// in one call) are refused on every attempt: that error is Permanent.
	// A handler with more children calls Gather once for each part of
	// them, on every run, and returns ErrAwaitChildren if any call did.
	Gather(ctx context.Context, children ...Child) ([]ChildResult, error)
}

// MaxGatherChildren is the most children one Gather call takes, as the
// API's batch submission does: each call spawns its children in one
// transaction.
const MaxGatherChildren = task.MaxBatchSize

// Child is a task a handler spawns with Gather.
type Child struct {
	// Key names the child among its parent's children: letters, digits,
	// '.', '_', '-', ':' or '/', at most 255.
	Key  string
	Type string
	// Payload is encoded as the child's JSON object payload.
	Payload any
	// MaxAttempts: 0 is the default (3). The child takes its parent's
	// priority.
	MaxAttempts int
}

// ChildResult is a spawned child's outcome.
type ChildResult struct {
	Key    string
	TaskID uuid.UUID
	// Status is COMPLETED, FAILED or CANCELLED; in the outcomes Gather
	// returns with ErrAwaitChildren, a child still running is PENDING or
	// IN_PROGRESS.
	Status string
	// Result is the child's result when it completed; Error why it failed.
	Result json.RawMessage
	Error  string
}

// Completed reports whether the child completed.
func (c ChildResult) Completed() bool { return c.Status == string(task.StatusCompleted) }

// HandlerFunc runs one task.
type HandlerFunc func(ctx context.Context, t Task, r Reporter) (any, error)

// Handler binds a task type to the function that runs it.
type Handler struct {
	Type string
	Func HandlerFunc
}

// Handle returns the handler of a task type. It panics on a type the API
// would refuse, since that is a programming error found at start-up.
func Handle(taskType string, fn HandlerFunc) Handler {
	if err := task.ValidateType(taskType); err != nil {
		panic(fmt.Sprintf("conveyor: invalid task type %q: %s", taskType, err.Message))
	}
	if fn == nil {
		panic("conveyor: nil handler for " + taskType)
	}
	return Handler{Type: taskType, Func: fn}
}

// Why a running handler's context was cancelled (see context.Cause).
var (
	// ErrCancelled: the task was cancelled through the API. It ends
	// CANCELLED.
	ErrCancelled = errors.New("conveyor: task cancelled")
	// ErrLost: this worker no longer holds the task: its lease expired, and
	// the attempt was ended (retried or failed as attempts allow); or the
	// worker could not renew the lease for a lease's length (the database
	// unreachable), and the lease reaper may give the task to another
	// worker. Nothing the handler does is stored.
	ErrLost = errors.New("conveyor: task lost by this worker")
	// ErrShutdown: the worker is stopping and the grace period is over. The
	// task is handed back and runs again elsewhere, unless the handler
	// returns a result with no error all the same: then it completes. A
	// handler still running a heartbeat interval later has its task
	// handed back without it, before the worker exits.
	ErrShutdown = errors.New("conveyor: worker shutting down")
	// ErrTimeout: the attempt ran longer than its task's timeout (or the
	// worker's maximum run time), or its handler reported no progress for
	// the task's heartbeat timeout. It fails as timed out, and is retried
	// if attempts are left.
	ErrTimeout = errors.New("conveyor: attempt timed out")
	// ErrAwaitChildren: Gather's children have not all finished. A handler
	// returns it as it is; the task waits for them and runs again. One
	// returned when Gather reported no child still running fails the task:
	// nothing would wake it.
	ErrAwaitChildren = errors.New("conveyor: waiting for children")
)

// permanentError marks an error that retrying cannot fix.
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent marks err as not worth retrying: the task fails at once,
// whatever attempts it has left. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

// IsPermanent reports whether err, or an error it wraps, was marked
// Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}

// PanicError is the error a handler's panic becomes.
type PanicError struct {
	Value any
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("handler panicked: %v", e.Value) }
