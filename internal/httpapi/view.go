package httpapi

import (
	"encoding/json"
	"strconv"
	"strings"
	"time"

	"github.com/conveyorhq/conveyor/internal/task"
)

// taskView is the JSON shape of a task.
type taskView struct {
	ID                string          `json:"id"`
	OrgID             string          `json:"org_id"`
	Visibility        []string        `json:"visibility"`
	Type              string          `json:"type"`
	Status            task.Status     `json:"status"`
	State             string          `json:"state"`
	Progress          int             `json:"progress"`
	Priority          int             `json:"priority"`
	Payload           json.RawMessage `json:"payload"`
	Metadata          json.RawMessage `json:"metadata"`
	Attempt           int             `json:"attempt"`
	MaxAttempts       int             `json:"max_attempts"`
	Error             string          `json:"error,omitempty"`
	IdempotencyKey    string          `json:"idempotency_key,omitempty"`
	InputHash         string          `json:"input_hash,omitempty"`
	Version           int             `json:"version"`
	WorkerID          string          `json:"worker_id,omitempty"`
	LeaseExpiresAt    *time.Time      `json:"lease_expires_at,omitempty"`
	NextRunAt         time.Time       `json:"next_run_at"`
	CancelRequestedAt *time.Time      `json:"cancel_requested_at,omitempty"`
	CreatedAt         time.Time       `json:"created_at"`
	UpdatedAt         time.Time       `json:"updated_at"`
	StartedAt         *time.Time      `json:"started_at,omitempty"`
	CompletedAt       *time.Time      `json:"completed_at,omitempty"`
	Result            json.RawMessage `json:"result,omitempty"`
	TraceID           string          `json:"trace_id,omitempty"`
	TraceURL          string          `json:"trace_url,omitempty"`
	schedulingView
	TimeoutSeconds          int `json:"timeout_seconds,omitempty"`
	HeartbeatTimeoutSeconds int `json:"heartbeat_timeout_seconds,omitempty"`
}

// schedulingView is where a task came from and what holds it back: its job
// and tick, its concurrency key, and whether it waits for admission (a
// limit's slot, a paused job or type, its turn in a busy type).
type schedulingView struct {
	JobID          string     `json:"job_id,omitempty"`
	ScheduledAt    *time.Time `json:"scheduled_at,omitempty"`
	ConcurrencyKey string     `json:"concurrency_key,omitempty"`
	Waiting        bool       `json:"waiting"`
}

func schedulingOf(t task.Task) schedulingView {
	v := schedulingView{ScheduledAt: t.ScheduledAt, ConcurrencyKey: t.ConcurrencyKey,
		Waiting: t.Status == task.StatusPending && !t.Admitted}
	if t.JobID != nil {
		v.JobID = t.JobID.String()
	}
	return v
}

// toTaskView converts a domain task to its JSON shape.
func (s *server) toTaskView(t task.Task) taskView {
	v := taskView{
		ID: t.ID.String(), OrgID: t.OrgID.String(), Visibility: visibilityOf(t), Type: t.Type, Status: t.Status,
		State: t.State, Progress: t.Progress, Priority: t.Priority, Payload: t.Payload, Metadata: t.Metadata,
		Attempt: t.Attempt, MaxAttempts: t.MaxAttempts, Error: t.Error, IdempotencyKey: t.IdempotencyKey,
		InputHash: t.InputHash, Version: t.Version, WorkerID: t.WorkerID, LeaseExpiresAt: t.LeaseExpiresAt,
		NextRunAt: t.NextRunAt, CancelRequestedAt: t.CancelRequestedAt, CreatedAt: t.CreatedAt,
		UpdatedAt: t.UpdatedAt, StartedAt: t.StartedAt, CompletedAt: t.CompletedAt, Result: t.Result,
		schedulingView: schedulingOf(t), TimeoutSeconds: int(t.Timeout / time.Second),
		HeartbeatTimeoutSeconds: int(t.HeartbeatTimeout / time.Second),
	}
	v.TraceID, v.TraceURL = s.trace(t.Traceparent)
	return v
}

// trace is the trace id of a W3C traceparent and its page in Jaeger's UI,
// as a task's or a run's JSON names them.
func (s *server) trace(traceparent string) (id, url string) {
	id = traceID(traceparent)
	// A trace its sampler dropped (every trace when nothing is exported)
	// was never sent to Jaeger: a link would lead to "trace not found".
	if id != "" && sampled(traceparent) {
		url = strings.TrimRight(s.cfg.JaegerUIURL, "/") + "/trace/" + id
	}
	return id, url
}

// taskSummary is the JSON shape of a task in a listing: the task without
// the client's documents (payload, metadata) and the result, which its own
// GET returns.
type taskSummary struct {
	ID                string      `json:"id"`
	OrgID             string      `json:"org_id"`
	Visibility        []string    `json:"visibility"`
	Type              string      `json:"type"`
	Status            task.Status `json:"status"`
	State             string      `json:"state"`
	Progress          int         `json:"progress"`
	Priority          int         `json:"priority"`
	Attempt           int         `json:"attempt"`
	MaxAttempts       int         `json:"max_attempts"`
	Error             string      `json:"error,omitempty"`
	IdempotencyKey    string      `json:"idempotency_key,omitempty"`
	Version           int         `json:"version"`
	WorkerID          string      `json:"worker_id,omitempty"`
	NextRunAt         time.Time   `json:"next_run_at"`
	CancelRequestedAt *time.Time  `json:"cancel_requested_at,omitempty"`
	CreatedAt         time.Time   `json:"created_at"`
	UpdatedAt         time.Time   `json:"updated_at"`
	StartedAt         *time.Time  `json:"started_at,omitempty"`
	CompletedAt       *time.Time  `json:"completed_at,omitempty"`
	TraceID           string      `json:"trace_id,omitempty"`
	schedulingView
}

func toTaskSummaries(ts []task.Task) []taskSummary {
	out := make([]taskSummary, len(ts))
	for i, t := range ts {
		out[i] = taskSummary{
			ID: t.ID.String(), OrgID: t.OrgID.String(), Visibility: visibilityOf(t), Type: t.Type, Status: t.Status,
			State: t.State, Progress: t.Progress, Priority: t.Priority, Attempt: t.Attempt, MaxAttempts: t.MaxAttempts,
			Error: t.Error, IdempotencyKey: t.IdempotencyKey, Version: t.Version, WorkerID: t.WorkerID,
			NextRunAt: t.NextRunAt, CancelRequestedAt: t.CancelRequestedAt, CreatedAt: t.CreatedAt,
			UpdatedAt: t.UpdatedAt, StartedAt: t.StartedAt, CompletedAt: t.CompletedAt,
			TraceID: traceID(t.Traceparent), schedulingView: schedulingOf(t),
		}
	}
	return out
}

// visibilityOf is a task's visibility, [] rather than null when open.
func visibilityOf(t task.Task) []string {
	if t.Visibility == nil {
		return []string{}
	}
	return t.Visibility
}

// traceID extracts the trace id of a W3C traceparent (version-traceid-spanid-flags).
func traceID(traceparent string) string {
	parts := strings.Split(traceparent, "-")
	if len(parts) != 4 || len(parts[1]) != 32 || parts[1] == strings.Repeat("0", 32) {
		return ""
	}
	return parts[1]
}

// sampled says whether a W3C traceparent has its sampled flag set: whether
// its spans were recorded and exported.
func sampled(traceparent string) bool {
	parts := strings.Split(traceparent, "-")
	if len(parts) != 4 || len(parts[3]) != 2 {
		return false
	}
	flags, err := strconv.ParseUint(parts[3], 16, 8)
	return err == nil && flags&1 == 1
}

// eventView is the JSON shape of a task event. Type is the task's, in
// streams; Result, on the COMPLETED event of one task's stream.
type eventView struct {
	ID        int64           `json:"id"`
	TaskID    string          `json:"task_id"`
	Type      string          `json:"type,omitempty"`
	Status    task.Status     `json:"status"`
	State     string          `json:"state"`
	Progress  int             `json:"progress"`
	Error     string          `json:"error,omitempty"`
	Detail    json.RawMessage `json:"detail,omitempty"`
	Actor     task.Actor      `json:"actor"`
	By        *task.Principal `json:"by,omitempty"`
	Result    json.RawMessage `json:"result,omitempty"`
	CreatedAt time.Time       `json:"created_at"`
}

func toEventView(e task.Event) eventView {
	return eventView{ID: e.ID, TaskID: e.TaskID.String(), Type: e.Type, Status: e.Status, State: e.State,
		Progress: e.Progress, Error: e.Error, Detail: e.Detail, Actor: e.Actor, By: e.By, Result: e.Result,
		CreatedAt: e.CreatedAt}
}

func toEventViews(es []task.Event) []eventView {
	out := make([]eventView, len(es))
	for i, e := range es {
		out[i] = toEventView(e)
	}
	return out
}
