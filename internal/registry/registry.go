// Package registry describes the worker processes of a deployment as the
// database records them: who they are, what they run, and who leads the
// maintenance duties. The worker writes these records and, later, the API
// and the dashboard read them; neither owns the types.
package registry

import "time"

// Worker is one worker process in the registry.
type Worker struct {
	ID          string
	Hostname    string
	PID         int
	Concurrency int
	// Types are the task types it has handlers for.
	Types   []string
	Version string
}

// Seen is a worker as the registry last heard from it.
type Seen struct {
	Worker
	StartedAt       time.Time
	LastHeartbeatAt time.Time
}

// Fleet is the registry as the API shows it: the live workers, and the
// worker that leads maintenance ("" when none does).
type Fleet struct {
	Workers []Seen
	Leader  string
}

// Maintenance is the name of the maintenance duty in the leaders table.
const Maintenance = "maintenance"
