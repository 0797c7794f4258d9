package apiclient

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"strconv"
	"time"
)

// Run statuses.
const (
	RunRunning   = "RUNNING"
	RunCompleted = "COMPLETED"
	RunFailed    = "FAILED"
	RunCancelled = "CANCELLED"
)

// The statuses of a run's node that has no task of its own (else its
// status is its task's: StatusPending, StatusInProgress, …).
const (
	// NodeWaiting is a node whose parents have not all completed.
	NodeWaiting = "WAITING"
	// NodeSubmitted is a submitted node whose task is gone (deleted), so
	// that its status is not known.
	NodeSubmitted = "SUBMITTED"
	// NodeMemoized is a node that took the result of an earlier run's.
	NodeMemoized = "MEMOIZED"
	// NodeSkipped is a node that will not run: its run failed or was
	// cancelled first.
	NodeSkipped = "SKIPPED"
)

// WorkflowNode is one node of a workflow: a job, the nodes it runs after,
// and the datasets it reads and writes.
type WorkflowNode struct {
	Name           string   `json:"name"`
	Job            string   `json:"job"`
	DependsOn      []string `json:"depends_on,omitempty"`
	InputDatasets  []string `json:"input_datasets,omitempty"`
	OutputDatasets []string `json:"output_datasets,omitempty"`
}

// Workflow is a declared workflow, a DAG of jobs, as the API answers it.
type Workflow struct {
	Document
	ID   string `json:"id"`
	Name string `json:"name"`
	// OnFailure is "stop" or "continue".
	OnFailure string `json:"on_failure"`
	Memoize   bool   `json:"memoize"`
	// Source is nil for a workflow that runs only when started.
	Source *JobSource     `json:"source,omitempty"`
	Active bool           `json:"active"`
	Nodes  []WorkflowNode `json:"nodes"`
	// ConfigHash is the hash of the workflow's definition.
	ConfigHash string `json:"config_hash"`
	// NextTickAt is when the schedule next starts a run; nil for a
	// workflow without a source or an inactive one.
	NextTickAt *time.Time `json:"next_tick_at,omitempty"`
	CreatedAt  time.Time  `json:"created_at"`
	UpdatedAt  time.Time  `json:"updated_at"`
}

// WorkflowList is the org's workflows.
type WorkflowList struct {
	Document
	Workflows []Workflow `json:"workflows"`
}

// RunNode is a node of a run and where it stands.
type RunNode struct {
	Name           string   `json:"name"`
	Job            string   `json:"job"`
	DependsOn      []string `json:"depends_on"`
	InputDatasets  []string `json:"input_datasets"`
	OutputDatasets []string `json:"output_datasets"`
	// Status is the task's status (StatusPending, …) while the node has a
	// task of its own, else NodeWaiting, NodeMemoized or NodeSkipped.
	Status string `json:"status"`
	// State is the node's own state: NodeWaiting, NodeSubmitted,
	// NodeMemoized or NodeSkipped.
	State string `json:"state"`
	// TaskID is the node's task or, for a memoized node, the earlier task
	// whose result it took (in run MemoizedFrom).
	TaskID string `json:"task_id,omitempty"`
	// TaskState is the task's state, the text its handler reports.
	TaskState    string `json:"task_state,omitempty"`
	Progress     int    `json:"progress"`
	Attempt      int    `json:"attempt"`
	Memoized     bool   `json:"memoized"`
	MemoizedFrom string `json:"memoized_from,omitempty"`
}

// Run is one run of a workflow. Read by itself it has its nodes, in the
// workflow's topological order; in a listing it has none.
type Run struct {
	Document
	ID        string `json:"id"`
	Workflow  string `json:"workflow"`
	Status    string `json:"status"`
	OnFailure string `json:"on_failure"`
	Memoize   bool   `json:"memoize"`
	Force     bool   `json:"force"`
	// Params is the JSON object the run's nodes read.
	Params json.RawMessage `json:"params"`
	// ScheduledAt is the tick that started the run, for a scheduled one.
	ScheduledAt *time.Time `json:"scheduled_at,omitempty"`
	Error       string     `json:"error,omitempty"`
	CreatedAt   time.Time  `json:"created_at"`
	UpdatedAt   time.Time  `json:"updated_at"`
	FinishedAt  *time.Time `json:"finished_at,omitempty"`
	// TraceID is the trace the run's nodes are submitted in, and TraceURL
	// its page in Jaeger (absent when the trace was not exported), as a
	// task's.
	TraceID  string    `json:"trace_id,omitempty"`
	TraceURL string    `json:"trace_url,omitempty"`
	Nodes    []RunNode `json:"nodes,omitempty"`
}

// Ended reports whether the run is no longer RUNNING.
func (r Run) Ended() bool { return r.Status != RunRunning }

// RunList is a page of runs, newest first.
type RunList struct {
	Document
	Runs []Run `json:"runs"`
	// NextAfter is the after of the next page; "" on the last.
	NextAfter string `json:"next_after,omitempty"`
}

// StartRunRequest is the body of POST /v1/workflows/{name}/runs.
type StartRunRequest struct {
	// Params is a JSON object the run's nodes read; nil for {}.
	Params json.RawMessage `json:"params,omitempty"`
	// Force runs every node, even those an earlier run memoized.
	Force bool `json:"force,omitempty"`
}

// DatasetRef is a node of a workflow that writes or reads a dataset.
type DatasetRef struct {
	Workflow string `json:"workflow"`
	Node     string `json:"node"`
	Job      string `json:"job"`
}

// DatasetVersion is one version of a dataset: what a node's completed
// task wrote.
type DatasetVersion struct {
	Version   int64     `json:"version"`
	RunID     string    `json:"run_id,omitempty"`
	Node      string    `json:"node,omitempty"`
	TaskID    string    `json:"task_id,omitempty"`
	CreatedAt time.Time `json:"created_at"`
}

// Lineage is which workflow nodes produce and consume a dataset, and its
// latest versions, newest first.
type Lineage struct {
	Document
	Dataset   string           `json:"dataset"`
	Producers []DatasetRef     `json:"producers"`
	Consumers []DatasetRef     `json:"consumers"`
	Versions  []DatasetVersion `json:"versions"`
}

// Workflows lists the org's workflows.
func (c *Client) Workflows(ctx context.Context) (WorkflowList, error) {
	var l WorkflowList
	_, err := c.do(ctx, request{method: http.MethodGet, path: "/v1/workflows"}, &l)
	return l, err
}

// Workflow returns a workflow by name.
func (c *Client) Workflow(ctx context.Context, name string) (Workflow, error) {
	var w Workflow
	_, err := c.do(ctx, request{method: http.MethodGet, path: workflowPath(name)}, &w)
	return w, err
}

// StartRun starts a run of the workflow name with params (a JSON object;
// nil for {}) and returns it, with its nodes. A forced run ignores
// memoization: every node runs.
func (c *Client) StartRun(ctx context.Context, name string, params json.RawMessage, force bool) (Run, error) {
	var r Run
	_, err := c.do(ctx, request{method: http.MethodPost, path: workflowPath(name) + "/runs",
		body: StartRunRequest{Params: params, Force: force}}, &r)
	return r, err
}

// Runs lists a page of runs, newest first: the workflow's, or every
// workflow's when it is "". after is the NextAfter of the previous page
// ("" for the first); limit is the most runs of a page, 1 to 200, or 0 for
// the API's default (50).
func (c *Client) Runs(ctx context.Context, workflow, after string, limit int) (RunList, error) {
	q := url.Values{}
	if after != "" {
		q.Set("after", after)
	}
	if limit > 0 {
		q.Set("limit", strconv.Itoa(limit))
	}
	path := "/v1/runs"
	if workflow != "" {
		path = workflowPath(workflow) + "/runs"
	}
	var l RunList
	_, err := c.do(ctx, request{method: http.MethodGet, path: path, query: q}, &l)
	return l, err
}

// Run returns a run, with its nodes.
func (c *Client) Run(ctx context.Context, id string) (Run, error) {
	var r Run
	_, err := c.do(ctx, request{method: http.MethodGet, path: runPath(id)}, &r)
	return r, err
}

// CancelRun cancels a RUNNING run: its nodes not yet submitted are
// skipped, its pending tasks cancelled and its running ones asked to stop.
// A run that already ended is a conflict (409), unless tasks of it are
// still in flight and not yet asked to stop: they are, as above.
func (c *Client) CancelRun(ctx context.Context, id string) (Run, error) {
	return c.runAction(ctx, id, "cancel")
}

// RetryRun resumes a FAILED or CANCELLED run: its nodes that did not
// complete run again, those that did keep their results. Any other run is
// a conflict (409).
func (c *Client) RetryRun(ctx context.Context, id string) (Run, error) {
	return c.runAction(ctx, id, "retry")
}

func (c *Client) runAction(ctx context.Context, id, action string) (Run, error) {
	var r Run
	_, err := c.do(ctx, request{method: http.MethodPost, path: runPath(id) + "/" + action}, &r)
	return r, err
}

// Lineage tells which workflow nodes produce and consume a dataset, and
// its latest versions.
func (c *Client) Lineage(ctx context.Context, dataset string) (Lineage, error) {
	var l Lineage
	_, err := c.do(ctx, request{method: http.MethodGet, path: "/v1/lineage", query: url.Values{"dataset": {dataset}}}, &l)
	return l, err
}

func workflowPath(name string) string { return "/v1/workflows/" + url.PathEscape(name) }

func runPath(id string) string { return "/v1/runs/" + url.PathEscape(id) }
