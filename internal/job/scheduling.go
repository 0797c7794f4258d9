package job

import (
	"context"
	"time"

	"github.com/google/uuid"
)

// AdmitConfig tunes an admission pass.
type AdmitConfig struct {
	// Window is how many admitted, due and unclaimed tasks a type may have
	// in its queue before new ones wait in PostgreSQL and are admitted
	// round-robin across orgs. 0: the concurrency of the type's live
	// workers, at least MinWindow.
	Window    int
	MinWindow int
	// DeadAfter: workers silent for longer do not count.
	DeadAfter time.Duration
	// RecountAfter spaces the counts of a type's queued tasks while it is
	// in fair mode and none of its tasks waits for admission: the count
	// then only decides when it admits directly again, which may happen
	// this much later (a task submitted meanwhile waits, and is admitted by
	// the next pass). A type that admits directly is counted on every pass,
	// so that a flood turns fair mode on at once, and so is a type with
	// tasks waiting, as its room in the queue decides how many go in. 0:
	// every pass.
	RecountAfter time.Duration
	// MaxGroups and MaxAdmit bound one pass.
	MaxGroups int
	MaxAdmit  int
}

// AdmitStats tells what a pass did.
type AdmitStats struct {
	Admitted int
	// Fair lists the types in fair mode after the pass.
	Fair []string
	// Waiting: tasks still wait for admission.
	Waiting bool
	// Busy: another transaction held the scheduler's lock (a pause, an
	// apply, a deposed leader's pass), so the pass read and changed
	// nothing; Fair then says nothing of the types' modes.
	Busy bool
}

// CronConfig tunes a cron pass.
type CronConfig struct {
	// CatchUp: ticks missed by less than this are all made (a leader's
	// failover, a short outage); older ones follow the job's missed
	// policy.
	CatchUp time.Duration
	// MaxJobs and MaxTicks bound one pass.
	MaxJobs  int
	MaxTicks int
	// Trace, when set, starts the trace of a pass that found something due,
	// before its first write, and returns the context of the pass's span:
	// the tasks the pass makes carry it. A pass that finds nothing due (most
	// passes, several a second) starts none.
	Trace func(context.Context) context.Context
}

// CronStats tells what a cron pass did.
type CronStats struct {
	Jobs, Made, Skipped int
	// Errors are jobs whose schedule no longer parses (it did when it was
	// applied; a time zone database may have changed).
	Errors map[uuid.UUID]error
}

// Stored is a job as the database keeps it: its definition and its state.
type Stored struct {
	ID         uuid.UUID
	Name       string
	Definition Definition
	ConfigHash string
	// PausedAt is set while the job is paused.
	PausedAt *time.Time
	// NextTickAt is the schedule's next tick not yet made.
	NextTickAt *time.Time
	CreatedAt  time.Time
	UpdatedAt  time.Time
}

// TypeState is a task type's limits and pause in one org.
type TypeState struct {
	TypeLimit
	PausedAt *time.Time
}
