package apiclient

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/conveyorhq/conveyor/internal/job"
)

// JobSource is what triggers a job on its own: a cron schedule.
type JobSource struct {
	Kind     string `json:"kind"`
	Schedule string `json:"schedule"`
	Timezone string `json:"timezone"`
	Missed   string `json:"missed"`
}

// Job is a declared job as the API answers it: its definition, then its
// state.
type Job struct {
	Document
	ID       string          `json:"id"`
	Name     string          `json:"name"`
	Type     string          `json:"type"`
	Payload  json.RawMessage `json:"payload,omitempty"`
	Priority int             `json:"priority"`
	// Source is nil for a job that runs only when triggered.
	Source      *JobSource `json:"source,omitempty"`
	MaxAttempts int        `json:"max_attempts"`
	// The timeouts and limits are 0 when the job has none.
	TimeoutSeconds          int        `json:"timeout_seconds,omitempty"`
	HeartbeatTimeoutSeconds int        `json:"heartbeat_timeout_seconds,omitempty"`
	MaxConcurrency          int        `json:"max_concurrency,omitempty"`
	MaxConcurrencyPerKey    int        `json:"max_concurrency_per_key,omitempty"`
	Active                  bool       `json:"active"`
	ConfigHash              string     `json:"config_hash"`
	Paused                  bool       `json:"paused"`
	PausedAt                *time.Time `json:"paused_at,omitempty"`
	// NextTickAt is when the schedule next makes a task; nil for a job
	// without a source, an inactive one or a paused one.
	NextTickAt *time.Time `json:"next_tick_at,omitempty"`
	CreatedAt  time.Time  `json:"created_at"`
	UpdatedAt  time.Time  `json:"updated_at"`
}

// JobList is the org's jobs.
type JobList struct {
	Document
	Jobs []Job `json:"jobs"`
}

// TypeState is a task type's limits and pause in the org.
type TypeState struct {
	Document
	Type string `json:"type"`
	// The limits are 0 when the type has none.
	MaxConcurrency       int        `json:"max_concurrency,omitempty"`
	MaxConcurrencyPerKey int        `json:"max_concurrency_per_key,omitempty"`
	Paused               bool       `json:"paused"`
	PausedAt             *time.Time `json:"paused_at,omitempty"`
}

// TypeList is the types the org has limited or paused.
type TypeList struct {
	Document
	Types []TypeState `json:"types"`
}

// ApplyOptions says how to apply a jobs file.
type ApplyOptions struct {
	// DryRun answers what applying would change, and changes nothing.
	DryRun bool
	// Prune deletes the jobs and type limits the file leaves out.
	Prune bool
}

// ApplyResult is what applying a jobs file changed, or for a dry run
// would change: one entry per job and type limit, in the order job.Format
// shows them.
type ApplyResult struct {
	Document
	DryRun  bool         `json:"dry_run"`
	Changes []job.Change `json:"changes"`
}

// Apply applies a jobs file, YAML or JSON, sent as it is so that the API's
// mistakes point at its lines. A file with mistakes changes nothing: the
// *Error's Problems list them.
func (c *Client) Apply(ctx context.Context, file []byte, opts ApplyOptions) (ApplyResult, error) {
	q := url.Values{"dry_run": {strconv.FormatBool(opts.DryRun)}, "prune": {strconv.FormatBool(opts.Prune)}}
	var r ApplyResult
	_, err := c.do(ctx, request{method: http.MethodPost, path: "/v1/jobs/apply", query: q,
		body: rawBody{contentType: "application/yaml", data: file}}, &r)
	return r, err
}

// Jobs lists the org's jobs.
func (c *Client) Jobs(ctx context.Context) (JobList, error) {
	var l JobList
	_, err := c.do(ctx, request{method: http.MethodGet, path: "/v1/jobs"}, &l)
	return l, err
}

// Job returns a job by name.
func (c *Client) Job(ctx context.Context, name string) (Job, error) {
	var j Job
	_, err := c.do(ctx, request{method: http.MethodGet, path: jobPath(name)}, &j)
	return j, err
}

// TriggerRequest is the body of POST /v1/jobs/{name}/trigger; empty fields
// keep the job's own.
type TriggerRequest struct {
	// Payload replaces the job's payload.
	Payload        json.RawMessage `json:"payload,omitempty"`
	ConcurrencyKey string          `json:"concurrency_key,omitempty"`
}

// TriggerJob makes a task of a job now and returns it.
func (c *Client) TriggerJob(ctx context.Context, name string, in TriggerRequest) (Task, error) {
	var t Task
	_, err := c.do(ctx, request{method: http.MethodPost, path: jobPath(name) + "/trigger", body: in}, &t)
	return t, err
}

// PauseJob pauses a job: its schedule stops ticking and its tasks not yet
// started wait; running ones finish.
func (c *Client) PauseJob(ctx context.Context, name string) (Job, error) {
	return c.jobAction(ctx, name, "pause")
}

// ResumeJob resumes a paused job.
func (c *Client) ResumeJob(ctx context.Context, name string) (Job, error) {
	return c.jobAction(ctx, name, "resume")
}

func (c *Client) jobAction(ctx context.Context, name, action string) (Job, error) {
	var j Job
	_, err := c.do(ctx, request{method: http.MethodPost, path: jobPath(name) + "/" + action}, &j)
	return j, err
}

func jobPath(name string) string { return "/v1/jobs/" + url.PathEscape(name) }

// Types lists the task types the org has limited or paused.
func (c *Client) Types(ctx context.Context) (TypeList, error) {
	var l TypeList
	_, err := c.do(ctx, request{method: http.MethodGet, path: "/v1/types"}, &l)
	return l, err
}

// PauseType pauses a task type in the org: its tasks not yet started
// wait; running ones finish.
func (c *Client) PauseType(ctx context.Context, typ string) (TypeState, error) {
	return c.typeAction(ctx, typ, "pause")
}

// ResumeType resumes a paused task type.
func (c *Client) ResumeType(ctx context.Context, typ string) (TypeState, error) {
	return c.typeAction(ctx, typ, "resume")
}

func (c *Client) typeAction(ctx context.Context, typ, action string) (TypeState, error) {
	var s TypeState
	_, err := c.do(ctx, request{method: http.MethodPost, path: "/v1/types/" + url.PathEscape(typ) + "/" + action}, &s)
	return s, err
}
