package task

import (
	"time"

	"github.com/google/uuid"

	"github.com/conveyorhq/conveyor/internal/outbox"
)

// MaxRunningShown bounds the tasks an overview lists for each worker.
const MaxRunningShown = 20

// Overview is an org's tasks at a glance, as one caller may see them.
type Overview struct {
	// Counts holds the number of tasks in each status; a status with none
	// is absent.
	Counts map[Status]int
	// Minutes are the last hour's 60 minutes, oldest first (the last one
	// is the current minute, so far).
	Minutes []Minute
	// Types are the queues of the types that have tasks PENDING or
	// IN_PROGRESS, by name.
	Types []Queue
	// Outbox is the org's backlog of messages to publish.
	Outbox outbox.Stats
	// Running lists, by worker id, the tasks that worker runs (at most
	// MaxRunningShown each, oldest first).
	Running map[string][]Running
}

// Minute is how many tasks ended in one minute.
type Minute struct {
	Start             time.Time
	Completed, Failed int
}

// Queue is where the tasks of one type stand.
type Queue struct {
	Type string
	// Pending tasks are due and wait for a worker; Scheduled ones are
	// PENDING but not due yet (a retry's backoff, or a run_at or delay
	// still ahead); Running are
	// IN_PROGRESS.
	Pending, Scheduled, Running int
	// OldestPendingAge is how long the longest-waiting due task has been
	// due.
	OldestPendingAge time.Duration
}

// Running is a task a worker runs.
type Running struct {
	ID   uuid.UUID
	Type string
}
