package httpapi

import (
	"context"
	"encoding/json"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/job"
	"github.com/conveyorhq/conveyor/internal/task"
)

// WorkflowStore is what the API needs of the database for workflows, runs
// and lineage, within the principal's org.
type WorkflowStore interface {
	Workflows(ctx context.Context, p auth.Principal) ([]job.StoredWorkflow, error)
	Workflow(ctx context.Context, p auth.Principal, name string) (job.StoredWorkflow, error)
	StartRun(ctx context.Context, p auth.Principal, name string, req job.RunRequest) (job.Run, error)
	Runs(ctx context.Context, p auth.Principal, workflow string, after uuid.UUID, limit int) ([]job.Run, error)
	Run(ctx context.Context, p auth.Principal, id uuid.UUID) (job.Run, error)
	CancelRun(ctx context.Context, p auth.Principal, id uuid.UUID, trace task.Carrier) (job.Run, error)
	RetryRun(ctx context.Context, p auth.Principal, id uuid.UUID, trace task.Carrier) (job.Run, error)
	Lineage(ctx context.Context, p auth.Principal, dataset string, limit int) (job.Lineage, error)
}

type workflowView struct {
	ID string `json:"id"`
	job.Workflow
	ConfigHash string     `json:"config_hash"`
	NextTickAt *time.Time `json:"next_tick_at,omitempty"`
	CreatedAt  time.Time  `json:"created_at"`
	UpdatedAt  time.Time  `json:"updated_at"`
}

func toWorkflowView(w job.StoredWorkflow) workflowView {
	v := workflowView{ID: w.ID.String(), Workflow: w.Definition, ConfigHash: w.ConfigHash,
		CreatedAt: w.CreatedAt, UpdatedAt: w.UpdatedAt}
	if w.Definition.Source != nil && w.Definition.Active {
		v.NextTickAt = w.NextTickAt
	}
	return v
}

type runNodeView struct {
	Name           string   `json:"name"`
	Job            string   `json:"job"`
	DependsOn      []string `json:"depends_on"`
	InputDatasets  []string `json:"input_datasets"`
	OutputDatasets []string `json:"output_datasets"`
	// Status is the task's status while the node has a task of its own,
	// else its state (WAITING, MEMOIZED, SKIPPED).
	Status       string     `json:"status"`
	State        string     `json:"state"`
	TaskID       *uuid.UUID `json:"task_id,omitempty"`
	TaskState    string     `json:"task_state,omitempty"`
	Progress     int        `json:"progress"`
	Attempt      int        `json:"attempt"`
	Memoized     bool       `json:"memoized"`
	MemoizedFrom *uuid.UUID `json:"memoized_from,omitempty"`
}

type runView struct {
	ID          uuid.UUID       `json:"id"`
	Workflow    string          `json:"workflow"`
	Status      string          `json:"status"`
	OnFailure   string          `json:"on_failure"`
	Memoize     bool            `json:"memoize"`
	Force       bool            `json:"force"`
	Params      json.RawMessage `json:"params"`
	ScheduledAt *time.Time      `json:"scheduled_at,omitempty"`
	Error       string          `json:"error,omitempty"`
	CreatedAt   time.Time       `json:"created_at"`
	UpdatedAt   time.Time       `json:"updated_at"`
	FinishedAt  *time.Time      `json:"finished_at,omitempty"`
	// TraceID and TraceURL are the trace the run's nodes are submitted in,
	// as a task's are.
	TraceID  string        `json:"trace_id,omitempty"`
	TraceURL string        `json:"trace_url,omitempty"`
	Nodes    []runNodeView `json:"nodes,omitempty"`
}

func (s *server) toRunView(r job.Run) runView {
	v := runView{ID: r.ID, Workflow: r.Workflow, Status: r.Status, OnFailure: r.OnFailure, Memoize: r.Memoize,
		Force: r.Force, Params: r.Params, ScheduledAt: r.ScheduledAt, Error: r.Error, CreatedAt: r.CreatedAt,
		UpdatedAt: r.UpdatedAt, FinishedAt: r.FinishedAt}
	v.TraceID, v.TraceURL = s.trace(r.Traceparent)
	for _, n := range r.Nodes {
		v.Nodes = append(v.Nodes, runNodeView{Name: n.Name, Job: n.Job, DependsOn: nonNil(n.DependsOn),
			InputDatasets: nonNil(n.InputDatasets), OutputDatasets: nonNil(n.OutputDatasets), Status: n.Status(),
			State: n.State, TaskID: n.TaskID, TaskState: n.TaskState, Progress: n.Progress, Attempt: n.Attempt,
			Memoized: n.State == job.NodeMemoized, MemoizedFrom: n.MemoizedFrom})
	}
	return v
}

func (s *server) handleListWorkflows() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		flows, err := s.Workflows.Workflows(r.Context(), principal(r))
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, map[string]any{"workflows": mapSlice(flows, toWorkflowView)})
	}
}

func (s *server) handleGetWorkflow() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		f, err := s.Workflows.Workflow(r.Context(), principal(r), chi.URLParam(r, "name"))
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, toWorkflowView(f))
	}
}

// handleStartRun starts a run of a workflow.
func (s *server) handleStartRun() http.HandlerFunc {
	type request struct {
		Params json.RawMessage `json:"params"`
		Force  bool            `json:"force"`
	}
	return func(w http.ResponseWriter, r *http.Request) {
		if err := noKeyHeader(r, "a run takes no idempotency key: each call starts a run"); err != nil {
			s.writeError(w, r, err)
			return
		}
		var req request
		if hasBody(r) {
			if err := s.decode(w, r, &req); err != nil {
				s.writeError(w, r, err)
				return
			}
		}
		run, err := s.Workflows.StartRun(r.Context(), principal(r), chi.URLParam(r, "name"),
			job.RunRequest{Params: req.Params, Force: req.Force, Trace: s.carrier(r)})
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		w.Header().Set("Location", "/v1/runs/"+run.ID.String())
		s.respond(w, r, http.StatusCreated, s.toRunView(run))
	}
}

// maxRunsPage bounds a page of runs.
const maxRunsPage = 200

// handleListRuns lists runs, newest first: a workflow's (by its name in the
// path) or, under /v1/runs, every workflow's (?workflow= narrows it).
func (s *server) handleListRuns() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		workflow, inPath := chi.URLParam(r, "name"), true
		if workflow == "" {
			workflow, inPath = r.URL.Query().Get("workflow"), false
		}
		if workflow != "" && task.ValidateType(workflow) != nil {
			// No workflow has such a name, so none of its runs would be
			// listed: a misspelt filter, or path, is said so, as the
			// other names of workflows, jobs and task types are, rather
			// than answered with no runs.
			if inPath {
				s.writeError(w, r, task.Errorf(task.ErrCodeNotFound, "workflow %q not found", workflow))
			} else {
				s.writeError(w, r, task.Invalid("workflow", "must match %s, got %q", task.TypePattern, workflow))
			}
			return
		}
		limit, err := limitParam(r.URL.Query(), 50, maxRunsPage)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		var after uuid.UUID
		if v := r.URL.Query().Get("after"); v != "" {
			id, err := uuid.Parse(v)
			if err != nil {
				s.writeError(w, r, task.Invalid("after", "must be a run id"))
				return
			}
			after = id
		}
		runs, err := s.Workflows.Runs(r.Context(), principal(r), workflow, after, limit+1)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		out := map[string]any{}
		if len(runs) > limit {
			runs = runs[:limit]
			out["next_after"] = runs[limit-1].ID
		}
		views := make([]runView, len(runs))
		for i, run := range runs {
			views[i] = s.toRunView(run)
		}
		out["runs"] = views
		s.respond(w, r, http.StatusOK, out)
	}
}

// runID reads the {id} of a run's path.
func runID(r *http.Request) (uuid.UUID, error) {
	id, err := uuid.Parse(chi.URLParam(r, "id"))
	if err != nil {
		return uuid.Nil, task.Errorf(task.ErrCodeNotFound, "run not found")
	}
	return id, nil
}

func (s *server) handleGetRun() http.HandlerFunc {
	return s.runAction(func(r *http.Request, id uuid.UUID) (job.Run, error) {
		return s.Workflows.Run(r.Context(), principal(r), id)
	})
}

func (s *server) handleCancelRun() http.HandlerFunc {
	return s.runAction(func(r *http.Request, id uuid.UUID) (job.Run, error) {
		return s.Workflows.CancelRun(r.Context(), principal(r), id, s.carrier(r))
	})
}

func (s *server) handleRetryRun() http.HandlerFunc {
	return s.runAction(func(r *http.Request, id uuid.UUID) (job.Run, error) {
		return s.Workflows.RetryRun(r.Context(), principal(r), id, s.carrier(r))
	})
}

// runAction answers with the run an action on it returns.
func (s *server) runAction(do func(r *http.Request, id uuid.UUID) (job.Run, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id, err := runID(r)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		run, err := do(r, id)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, s.toRunView(run))
	}
}

// handleLineage tells which workflow nodes produce and consume a dataset,
// and its latest versions.
func (s *server) handleLineage() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		dataset := r.URL.Query().Get("dataset")
		if dataset == "" {
			s.writeError(w, r, task.Invalid("dataset", "is required: /v1/lineage?dataset=NAME"))
			return
		}
		if err := job.ValidDataset(dataset); err != nil {
			// No node declares such a name: empty lists would read as a
			// dataset nothing uses, not as a misspelt one.
			s.writeError(w, r, task.Invalid("dataset", "%v", err))
			return
		}
		l, err := s.Workflows.Lineage(r.Context(), principal(r), dataset, 20)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, l)
	}
}
