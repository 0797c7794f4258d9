// Package task is Conveyor's domain: the task, its lifecycle, the rules a
// submission must follow and the errors every layer speaks. It imports no
// adapter.
package task

import (
	"encoding/json"
	"time"

	"github.com/google/uuid"
)

// Status is where a task stands in its lifecycle.
type Status string

// The statuses of SPEC 6.
const (
	StatusPending    Status = "PENDING"
	StatusInProgress Status = "IN_PROGRESS"
	StatusCompleted  Status = "COMPLETED"
	StatusFailed     Status = "FAILED"
	StatusCancelled  Status = "CANCELLED"
)

// Statuses lists every status, in lifecycle order.
var Statuses = []Status{StatusPending, StatusInProgress, StatusCompleted, StatusFailed, StatusCancelled}

// Terminal reports whether a task in this status will never run again on its
// own (only the retry endpoint revives it).
func (s Status) Terminal() bool {
	return s == StatusCompleted || s == StatusFailed || s == StatusCancelled
}

// Valid reports whether s is one of the known statuses.
func (s Status) Valid() bool {
	for _, v := range Statuses {
		if s == v {
			return true
		}
	}
	return false
}

// Actor says who wrote an event.
type Actor string

// The writers of task events.
const (
	ActorAPI    Actor = "API"
	ActorRelay  Actor = "RELAY"
	ActorWorker Actor = "WORKER"
	ActorSystem Actor = "SYSTEM"
)

// Human labels of the steps every task goes through.
const (
	StateQueued          = "Queued"
	StateRunning         = "Running"
	StateCancelled       = "Cancelled"
	StateCancelRequested = "Cancel requested"
	StateRetryScheduled  = "Retry scheduled"
	StateCompleted       = "Completed"
	StateFailed          = "Failed"
)

// DefaultTenant is the tenant of tasks submitted without one.
const DefaultTenant = "default"

// Task is the stored task as the rest of the system sees it.
type Task struct {
	ID                uuid.UUID
	TenantID          string
	Type              string
	Status            Status
	State             string
	Progress          int
	Priority          int
	Payload           json.RawMessage
	Metadata          json.RawMessage
	InputHash         string
	IdempotencyKey    string
	Error             string
	Attempt           int
	MaxAttempts       int
	Version           int
	WorkerID          string
	LeaseExpiresAt    *time.Time
	NextRunAt         time.Time
	CancelRequestedAt *time.Time
	Traceparent       string
	CreatedAt         time.Time
	UpdatedAt         time.Time
	StartedAt         *time.Time
	CompletedAt       *time.Time
	// Result is set once the task is COMPLETED and the reader asked for it.
	Result json.RawMessage
}

// Event is one entry of a task's append-only history.
type Event struct {
	ID        int64
	TaskID    uuid.UUID
	Status    Status
	State     string
	Progress  int
	Detail    json.RawMessage
	Actor     Actor
	CreatedAt time.Time
}

// Submitted is the outcome of one submission: the stored task, and whether
// this call created it or found it already there.
type Submitted struct {
	Task    Task
	Created bool
}

// ListFilter selects tasks for a listing. Zero values do not filter.
type ListFilter struct {
	Status Status
	Type   string
	// After is the keyset cursor: only tasks older than this id.
	After uuid.UUID
	Limit int
}

// CancelOutcome says what a cancel request did.
type CancelOutcome int

// The outcomes of a cancel request.
const (
	// Cancelled: the task was PENDING and is now CANCELLED.
	Cancelled CancelOutcome = iota + 1
	// CancelRequested: the task is running; its worker is being told.
	CancelRequested
)

// Carrier holds W3C trace context headers (traceparent, tracestate) on their
// way from a request to an outbox row and on to a message.
type Carrier map[string]string

// Lease is a worker's hold on a running task. Every write the worker makes
// while it holds the task is fenced by Version (and status IN_PROGRESS); a
// write that matches nothing means the hold is gone.
type Lease struct {
	TaskID   uuid.UUID
	WorkerID string
	Attempt  int
	Version  int
}

// Completion is a finished attempt's result, to be stored under its lease.
type Completion struct {
	Lease  Lease
	Result []byte
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
