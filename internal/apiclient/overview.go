package apiclient

import (
	"context"
	"net/http"
	"time"
)

// Overview is the org's tasks at a glance, and the deployment's workers.
type Overview struct {
	Document
	// AsOf is when the API read the overview: callers who would see the
	// same one share it, a large org's for a few seconds.
	AsOf time.Time `json:"as_of"`
	// Counts has the tasks per status, every status included.
	Counts   map[string]int `json:"counts"`
	LastHour LastHour       `json:"last_hour"`
	// Queues are the types with tasks PENDING or IN_PROGRESS, by name.
	Queues  []Queue  `json:"types"`
	Outbox  Outbox   `json:"outbox"`
	Workers []Worker `json:"workers"`
	// Leader is the id of the worker leading maintenance; empty when none
	// does.
	Leader string `json:"leader"`
}

// LastHour is what ended in each of the last 60 minutes.
type LastHour struct {
	// Minutes are oldest first; the last is the current minute so far.
	Minutes             []Minute `json:"minutes"`
	Completed           int      `json:"completed"`
	Failed              int      `json:"failed"`
	ThroughputPerMinute float64  `json:"throughput_per_minute"`
}

// Minute is what ended in one minute.
type Minute struct {
	// Minute is the minute's start.
	Minute    time.Time `json:"minute"`
	Completed int       `json:"completed"`
	Failed    int       `json:"failed"`
}

// Queue is where the tasks of a type stand.
type Queue struct {
	Type string `json:"type"`
	// Pending tasks are due: the queue's depth.
	Pending int `json:"pending"`
	// Scheduled tasks are PENDING but not due yet (a retry's backoff, or a
	// run_at or delay still ahead).
	Scheduled int `json:"scheduled"`
	Running   int `json:"running"`
	// OldestPendingAgeSeconds is how long the longest-waiting due task
	// has been due; 0 when none is.
	OldestPendingAgeSeconds float64 `json:"oldest_pending_age_seconds"`
}

// Outbox is the org's backlog of messages to publish.
type Outbox struct {
	// Depth counts the messages due to be published.
	Depth int64 `json:"depth"`
	// OldestAgeSeconds is how long the oldest due message has been due.
	OldestAgeSeconds float64 `json:"oldest_age_seconds"`
	// Parked counts the messages waiting for a worker of their type.
	Parked int64 `json:"parked"`
}

// Worker is a worker of the deployment heard from within the last minute.
type Worker struct {
	ID              string    `json:"id"`
	Hostname        string    `json:"hostname"`
	Types           []string  `json:"types"`
	Concurrency     int       `json:"concurrency"`
	Version         string    `json:"version"`
	LastHeartbeatAt time.Time `json:"last_heartbeat_at"`
	// Running are the caller's tasks it runs (those the caller may see),
	// oldest first, at most 20.
	Running []RunningTask `json:"running"`
}

// RunningTask is a task a worker runs.
type RunningTask struct {
	ID   string `json:"id"`
	Type string `json:"type"`
}

// Overview returns the org's tasks at a glance and the deployment's
// workers.
func (c *Client) Overview(ctx context.Context) (Overview, error) {
	var o Overview
	_, err := c.do(ctx, request{method: http.MethodGet, path: "/v1/overview"}, &o)
	return o, err
}
