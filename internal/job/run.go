package job

import (
	"encoding/json"
	"time"

	"github.com/google/uuid"

	"github.com/conveyorhq/conveyor/internal/task"
)

// RunRequest asks for a run of a workflow.
type RunRequest struct {
	// Params is a JSON object the run's nodes read ({} when left out).
	Params json.RawMessage
	// Force runs every node even when an earlier run memoized it.
	Force bool
	Trace task.Carrier
}

// Run is one run of a workflow and, when read whole, its graph.
type Run struct {
	ID          uuid.UUID
	Workflow    string
	Status      string
	OnFailure   string
	Memoize     bool
	Force       bool
	Params      json.RawMessage
	ScheduledAt *time.Time
	Error       string
	CreatedAt   time.Time
	UpdatedAt   time.Time
	FinishedAt  *time.Time
	// Traceparent is the W3C trace context the run's nodes are submitted
	// in: the request's (or cron pass's) that started the run, or the one
	// that last retried it; "" when none was given.
	Traceparent string
	// Nodes, in the workflow's topological order; empty in a listing.
	Nodes []RunNode
}

// RunNode is a node of a run with where it stands.
type RunNode struct {
	Name           string
	Job            string
	DependsOn      []string
	InputDatasets  []string
	OutputDatasets []string
	// State is NodeWaiting, NodeSubmitted, NodeMemoized or NodeSkipped.
	State string
	// TaskID is the node's task, or for a memoized node the earlier task
	// whose result it reuses (from run MemoizedFrom).
	TaskID       *uuid.UUID
	MemoizedFrom *uuid.UUID
	// The task's status, state, progress and attempt, when it has one.
	TaskStatus string
	TaskState  string
	Progress   int
	Attempt    int
}

// Status is the node's one-word standing: its task's status while it has
// a task of its own, else its state.
func (n RunNode) Status() string {
	if n.State == NodeSubmitted && n.TaskStatus != "" {
		return n.TaskStatus
	}
	return n.State
}

// DatasetRef is a node of a workflow that reads or writes a dataset.
type DatasetRef struct {
	Workflow string `json:"workflow"`
	Node     string `json:"node"`
	Job      string `json:"job"`
}

// DatasetVersion is one version of a dataset: the completed task of a node
// that wrote it.
type DatasetVersion struct {
	Version   int64      `json:"version"`
	RunID     *uuid.UUID `json:"run_id,omitempty"`
	Node      string     `json:"node,omitempty"`
	TaskID    *uuid.UUID `json:"task_id,omitempty"`
	CreatedAt time.Time  `json:"created_at"`
}

// Lineage is what produces and consumes a dataset, and its latest versions.
type Lineage struct {
	Dataset   string           `json:"dataset"`
	Producers []DatasetRef     `json:"producers"`
	Consumers []DatasetRef     `json:"consumers"`
	Versions  []DatasetVersion `json:"versions"`
}
