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

// The statuses. The lifecycle (lifecycle.go) says how a task moves between
// them; the schema's CHECK constraint holds the same list.
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
func (s Status) Valid() bool { return s.In(Statuses) }

// In reports whether s is one of set.
func (s Status) In(set []Status) bool {
	for _, v := range set {
		if s == v {
			return true
		}
	}
	return false
}

// TerminalStatuses lists the statuses a task ends in.
func TerminalStatuses() []Status {
	var out []Status
	for _, s := range Statuses {
		if s.Terminal() {
			out = append(out, s)
		}
	}
	return out
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

// Principal is who made a change through the API: a user or an API key,
// recorded on the change's event.
type Principal struct {
	Kind string    `json:"kind"` // "user" or "key"
	ID   uuid.UUID `json:"id"`
	Name string    `json:"name,omitempty"`
}

// Task is the stored task as the rest of the system sees it.
type Task struct {
	ID    uuid.UUID
	OrgID uuid.UUID
	Type  string
	// Visibility names the org roles whose members (and the org's admins)
	// alone see the task; empty, everyone in the org does.
	Visibility        []string
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
	// PublishedAt is when the broker last confirmed a task.run message
	// of the task.
	PublishedAt *time.Time
	CreatedAt   time.Time
	UpdatedAt   time.Time
	StartedAt   *time.Time
	CompletedAt *time.Time
	// Result is set once the task is COMPLETED and the reader asked for it.
	Result json.RawMessage

	// JobID is the job that made the task, ScheduledAt the tick of its
	// schedule it was made for.
	JobID       *uuid.UUID
	ScheduledAt *time.Time
	// ConcurrencyKey divides the limits of its job and type (per
	// customer, say); empty, the task has none.
	ConcurrencyKey string
	// Admitted is false while the task waits in PostgreSQL for a slot of
	// a limit, for its paused job or type to resume, or for its turn.
	Admitted bool
	// Timeout bounds each attempt's run time; HeartbeatTimeout the time
	// between two of its handler's heartbeats. Zero: none.
	Timeout          time.Duration
	HeartbeatTimeout time.Duration
	// RunID and Node: the workflow run and node the task runs, if any;
	// Inputs then holds the run's params and its parents' results
	// ({"params": {...}, "parents": {"node": result, ...}}).
	RunID  *uuid.UUID
	Node   string
	Inputs json.RawMessage
	// ParentID and ChildKey: the task that spawned this one, and the key
	// it gave it (one child per key and parent).
	ParentID *uuid.UUID
	ChildKey string
}

// Event is one entry of a task's append-only history. Event ids grow in
// the order a task's events are committed.
type Event struct {
	ID       int64
	TaskID   uuid.UUID
	Status   Status
	State    string
	Progress int
	// Error is the error the change set (a failure, a retry's reason).
	Error  string
	Detail json.RawMessage
	Actor  Actor
	// By is who made the change, for changes made through the API.
	By        *Principal
	CreatedAt time.Time

	// Of the task, for streams: its org, type and visibility.
	OrgID      uuid.UUID
	Type       string
	Visibility []string
	// Result is the task's result, on a COMPLETED event a stream of the
	// one task sends.
	Result json.RawMessage
}

// Submitted is the outcome of one submission: the stored task, and whether
// this call created it or found it already there.
type Submitted struct {
	Task    Task
	Created bool
}

// Filter selects tasks of an org, for a listing or a bulk action. Zero
// fields do not filter.
type Filter struct {
	Status Status
	Type   string
	// CreatedAfter (inclusive) and CreatedBefore (exclusive) bound when
	// the task was created.
	CreatedAfter, CreatedBefore time.Time
	// ID selects one task.
	ID uuid.UUID
	// MetaKey selects the tasks whose metadata holds the key with the
	// value MetaValue, compared as text (metadata->>key = value).
	MetaKey, MetaValue string
}

// ListFilter selects tasks for a listing.
type ListFilter struct {
	Filter
	// After is the keyset cursor: only tasks older than this id.
	After uuid.UUID
	Limit int
}

// EventFilter narrows a stream of events: to one task, a type, a status.
// Zero fields match everything.
type EventFilter struct {
	TaskID uuid.UUID
	Type   string
	Status Status
}

// Match reports whether e passes the filter.
func (f EventFilter) Match(e *Event) bool {
	return (f.TaskID == uuid.Nil || e.TaskID == f.TaskID) && (f.Type == "" || e.Type == f.Type) &&
		(f.Status == "" || e.Status == f.Status)
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

// ChildState is where a spawned child stands, as its parent's handler
// reads it.
type ChildState struct {
	Key    string
	ID     uuid.UUID
	Status Status
	Error  string
	Result json.RawMessage
}

// ChildKeyPattern is what a child's key may hold.
const ChildKeyPattern = `^[A-Za-z0-9._:/-]{1,255}$`
