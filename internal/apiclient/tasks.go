package apiclient

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"strconv"
	"time"
)

// Task statuses; the last three are terminal.
const (
	StatusPending    = "PENDING"
	StatusInProgress = "IN_PROGRESS"
	StatusCompleted  = "COMPLETED"
	StatusFailed     = "FAILED"
	StatusCancelled  = "CANCELLED"
)

// StateAwaiting is the state of a PENDING task whose handler spawned
// children and waits for them: it runs again when the last one ends.
const StateAwaiting = "Waiting for children"

// Terminal reports whether a task of status will change no more (unless
// it is retried).
func Terminal(status string) bool {
	return status == StatusCompleted || status == StatusFailed || status == StatusCancelled
}

// Task is a task as GET /v1/tasks/{id} answers it; in a listing the
// payload, metadata, input hash, lease, result and trace URL are absent.
type Task struct {
	Document
	ID                string          `json:"id"`
	OrgID             string          `json:"org_id"`
	Visibility        []string        `json:"visibility"`
	Type              string          `json:"type"`
	Status            string          `json:"status"`
	State             string          `json:"state"`
	Progress          int             `json:"progress"`
	Priority          int             `json:"priority"`
	Payload           json.RawMessage `json:"payload,omitempty"`
	Metadata          json.RawMessage `json:"metadata,omitempty"`
	Attempt           int             `json:"attempt"`
	MaxAttempts       int             `json:"max_attempts"`
	Error             string          `json:"error,omitempty"`
	IdempotencyKey    string          `json:"idempotency_key,omitempty"`
	InputHash         string          `json:"input_hash,omitempty"`
	Version           int             `json:"version"`
	WorkerID          string          `json:"worker_id,omitempty"`
	LeaseExpiresAt    *time.Time      `json:"lease_expires_at,omitempty"`
	NextRunAt         *time.Time      `json:"next_run_at,omitempty"`
	CancelRequestedAt *time.Time      `json:"cancel_requested_at,omitempty"`
	CreatedAt         time.Time       `json:"created_at"`
	UpdatedAt         *time.Time      `json:"updated_at,omitempty"`
	StartedAt         *time.Time      `json:"started_at,omitempty"`
	CompletedAt       *time.Time      `json:"completed_at,omitempty"`
	Result            json.RawMessage `json:"result,omitempty"`
	TraceID           string          `json:"trace_id,omitempty"`
	TraceURL          string          `json:"trace_url,omitempty"`
	// JobID is the job that made the task, and ScheduledAt the tick of
	// its schedule it was made for, if any.
	JobID          string     `json:"job_id,omitempty"`
	ScheduledAt    *time.Time `json:"scheduled_at,omitempty"`
	ConcurrencyKey string     `json:"concurrency_key,omitempty"`
	// Waiting says that a PENDING task waits to be admitted: for a slot
	// under a limit, or for its paused job or type to resume.
	Waiting bool `json:"waiting"`
	// The timeouts are 0 when the task has none, and in a listing.
	TimeoutSeconds          int `json:"timeout_seconds,omitempty"`
	HeartbeatTimeoutSeconds int `json:"heartbeat_timeout_seconds,omitempty"`
}

// Principal is who made a change through the API.
type Principal struct {
	Kind string `json:"kind"`
	ID   string `json:"id,omitempty"`
	Name string `json:"name,omitempty"`
}

// Event is one change of a task: an entry of its history, or a frame of a
// stream (which also carries the task's type, and its result on the
// COMPLETED event of a task's own stream).
type Event struct {
	Document
	ID        int64           `json:"id"`
	TaskID    string          `json:"task_id"`
	Type      string          `json:"type,omitempty"`
	Status    string          `json:"status"`
	State     string          `json:"state"`
	Progress  int             `json:"progress"`
	Actor     string          `json:"actor"`
	Detail    json.RawMessage `json:"detail,omitempty"`
	By        *Principal      `json:"by,omitempty"`
	Error     string          `json:"error,omitempty"`
	Result    json.RawMessage `json:"result,omitempty"`
	CreatedAt time.Time       `json:"created_at"`
}

// SubmitRequest is the body of POST /v1/tasks. Nil fields take the API's
// defaults.
type SubmitRequest struct {
	Type string `json:"type"`
	// Payload is sent unparsed (only compacted), so that its numbers
	// keep their exact text, which the API hashes to find duplicates.
	Payload     json.RawMessage `json:"payload,omitempty"`
	Priority    *int            `json:"priority,omitempty"`
	Metadata    json.RawMessage `json:"metadata,omitempty"`
	MaxAttempts *int            `json:"max_attempts,omitempty"`
	Dedupe      *bool           `json:"dedupe,omitempty"`
	Visibility  []string        `json:"visibility,omitempty"`
	// RunAt or Delay (a Go duration such as "90s") schedule the task.
	RunAt *time.Time `json:"run_at,omitempty"`
	Delay string     `json:"delay,omitempty"`
	// ConcurrencyKey groups tasks for the type's per-key limit.
	ConcurrencyKey string `json:"concurrency_key,omitempty"`
	// TimeoutSeconds bounds each attempt; HeartbeatTimeoutSeconds the
	// time between its heartbeats; 0 means none.
	TimeoutSeconds          int `json:"timeout_seconds,omitempty"`
	HeartbeatTimeoutSeconds int `json:"heartbeat_timeout_seconds,omitempty"`
}

// Submit submits a task; created is false when the API found it to be a
// duplicate and answered the existing task. key is the Idempotency-Key
// header, if not empty.
func (c *Client) Submit(ctx context.Context, in SubmitRequest, key string) (t Task, created bool, err error) {
	var h http.Header
	if key != "" {
		h = http.Header{"Idempotency-Key": {key}}
	}
	status, err := c.do(ctx, request{method: http.MethodPost, path: "/v1/tasks", header: h, body: in}, &t)
	return t, status == http.StatusCreated, err
}

// Task returns a task.
func (c *Client) Task(ctx context.Context, id string) (Task, error) {
	var t Task
	_, err := c.do(ctx, request{method: http.MethodGet, path: "/v1/tasks/" + url.PathEscape(id)}, &t)
	return t, err
}

// TaskFilter selects tasks, for a listing or a bulk action; zero fields
// do not filter, and the ones given must all hold.
type TaskFilter struct {
	Status string `json:"status,omitempty"`
	Type   string `json:"type,omitempty"`
	// CreatedAfter (inclusive) and CreatedBefore (exclusive) bound when
	// the task was created.
	CreatedAfter  time.Time `json:"created_after,omitzero"`
	CreatedBefore time.Time `json:"created_before,omitzero"`
	// Q is a task id (that task alone) or a metadata key=value (the tasks
	// whose metadata has the key with that value, compared as text).
	Q string `json:"q,omitempty"`
}

// addTo adds the filter to a query.
func (f TaskFilter) addTo(q url.Values) {
	set(q, "status", f.Status)
	set(q, "type", f.Type)
	if !f.CreatedAfter.IsZero() {
		q.Set("created_after", f.CreatedAfter.Format(time.RFC3339Nano))
	}
	if !f.CreatedBefore.IsZero() {
		q.Set("created_before", f.CreatedBefore.Format(time.RFC3339Nano))
	}
	set(q, "q", f.Q)
}

// ListFilter narrows a listing; zero fields are left to the API.
type ListFilter struct {
	TaskFilter
	Limit int
	// Cursor is the NextCursor of the previous page.
	Cursor string
}

// TaskPage is a page of a listing, newest first.
type TaskPage struct {
	Document
	Tasks []Task `json:"tasks"`
	// NextCursor fetches the next page; empty on the last.
	NextCursor string `json:"next_cursor,omitempty"`
}

// Tasks lists tasks, newest first, as summaries.
func (c *Client) Tasks(ctx context.Context, f ListFilter) (TaskPage, error) {
	q := url.Values{}
	f.addTo(q)
	set(q, "cursor", f.Cursor)
	if f.Limit > 0 {
		q.Set("limit", strconv.Itoa(f.Limit))
	}
	var p TaskPage
	_, err := c.do(ctx, request{method: http.MethodGet, path: "/v1/tasks", query: q}, &p)
	return p, err
}

// EventList is a page of a task's events, newest first.
type EventList struct {
	Document
	Events []Event `json:"events"`
	// NextCursor fetches the page of the events before these; empty on
	// the last.
	NextCursor string `json:"next_cursor,omitempty"`
}

// Events returns a page of a task's events (at most limit, 0 for the
// API's default), newest first: its most recent, or with cursor (the
// NextCursor of the previous page) those before that page.
func (c *Client) Events(ctx context.Context, id string, limit int, cursor string) (EventList, error) {
	q := url.Values{}
	if limit > 0 {
		q.Set("limit", strconv.Itoa(limit))
	}
	set(q, "cursor", cursor)
	var l EventList
	_, err := c.do(ctx, request{method: http.MethodGet, path: "/v1/tasks/" + url.PathEscape(id) + "/events", query: q}, &l)
	return l, err
}

// Cancel cancels a task: a PENDING one at once, a running one by request
// (requested is then true, and the task ends CANCELLED shortly).
func (c *Client) Cancel(ctx context.Context, id string) (t Task, requested bool, err error) {
	status, err := c.do(ctx, request{method: http.MethodPost, path: "/v1/tasks/" + url.PathEscape(id) + "/cancel"}, &t)
	return t, status == http.StatusAccepted, err
}

// Retry runs a FAILED or CANCELLED task again from attempt 0.
func (c *Client) Retry(ctx context.Context, id string) (Task, error) {
	var t Task
	_, err := c.do(ctx, request{method: http.MethodPost, path: "/v1/tasks/" + url.PathEscape(id) + "/retry"}, &t)
	return t, err
}

// BulkRequest is the body of POST /v1/tasks/cancel and /v1/tasks/retry.
type BulkRequest struct {
	Filter TaskFilter `json:"filter"`
	// DryRun counts the tasks the action would change, and changes none.
	DryRun bool `json:"dry_run,omitempty"`
	// Expected is the count the person confirmed (a dry run's Matched):
	// if the filter matches more tasks by then, the API answers 409 and
	// changes nothing; it never changes more than this many.
	Expected *int `json:"expected,omitempty"`
	// Limit bounds the tasks this call changes; 0 means the API's, 1000.
	Limit int `json:"limit,omitempty"`
}

// BulkResult is what a bulk action did, or for a dry run would do.
type BulkResult struct {
	Document
	// Matched is how many tasks the filter matches that the action can
	// change: all of them, not only those of this call.
	Matched int `json:"matched"`
	// Cancelled counts the tasks a cancel CANCELLED or asked to stop;
	// Retried the tasks a retry put back to PENDING.
	Cancelled int `json:"cancelled"`
	Retried   int `json:"retried"`
	// Skipped tasks changed between the count and their change, and were
	// left alone.
	Skipped int `json:"skipped"`
	// More says that more tasks match than this call took on: call again.
	More bool `json:"more"`
}

// CancelTasks cancels the tasks a filter matches, as Cancel does each, or
// with DryRun counts them.
func (c *Client) CancelTasks(ctx context.Context, in BulkRequest) (BulkResult, error) {
	var r BulkResult
	_, err := c.do(ctx, request{method: http.MethodPost, path: "/v1/tasks/cancel", body: in}, &r)
	return r, err
}

// RetryTasks retries the FAILED and CANCELLED tasks a filter matches, as
// Retry does each, or with DryRun counts them.
func (c *Client) RetryTasks(ctx context.Context, in BulkRequest) (BulkResult, error) {
	var r BulkResult
	_, err := c.do(ctx, request{method: http.MethodPost, path: "/v1/tasks/retry", body: in}, &r)
	return r, err
}

func set(q url.Values, k, v string) {
	if v != "" {
		q.Set(k, v)
	}
}
