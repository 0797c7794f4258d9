// Package conveyor is the public handler API of Conveyor: write a Handler
// for each task type you run, then build your own worker binary with
// worker.Main (package github.com/conveyorhq/conveyor/worker).
//
// A handler gets a context, the task and a Reporter. It returns a result
// (any value that encodes to a JSON object or value, kept small: a pointer to
// large artefacts, never the artefact) or an error. An error is retried with
// backoff until the task's max_attempts are spent, unless it is marked
// Permanent. A panic is recovered and treated as an error.
//
// The context is cancelled when the task is cancelled through the API, when
// the worker loses the task (its lease expired and another worker took it
// over), when the attempt runs past the worker's maximum run time, and when
// the worker shuts down past its grace period; context.Cause tells which
// (ErrCancelled, ErrLost, ErrTimeout, ErrShutdown). A handler must return
// soon after its context is done; whatever it returns then is ignored.
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
}

// Reporter records a running task's progress. Reports are durable (stored in
// PostgreSQL with an event each) and rate-limited: a handler may report as
// often as it likes, the latest value always lands.
type Reporter interface {
	// Progress sets the percentage done (0 to 100) and a human label of the
	// current step, such as "Resizing 3/10". It returns the context's cause
	// once the task was cancelled or lost, and an error for a percentage out
	// of range. Each report is also a heartbeat: a task with a heartbeat
	// timeout fails when its handler reports nothing for that long.
	Progress(ctx context.Context, percent int, state string) error
}

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
	// ErrLost: this worker no longer holds the task (its lease expired and
	// it was handed to another worker). Nothing the handler does is stored.
	ErrLost = errors.New("conveyor: task lost by this worker")
	// ErrShutdown: the worker is stopping and the grace period is over. The
	// task is handed back and runs again elsewhere.
	ErrShutdown = errors.New("conveyor: worker shutting down")
	// ErrTimeout: the attempt ran longer than its task's timeout (or the
	// worker's maximum run time). It fails as timed out, and is retried if
	// attempts are left.
	ErrTimeout = errors.New("conveyor: attempt timed out")
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
