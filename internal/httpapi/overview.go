package httpapi

import (
	"context"
	"net/http"
	"time"

	"github.com/conveyorhq/conveyor/internal/registry"
	"github.com/conveyorhq/conveyor/internal/task"
)

// workerLiveWithin is how recently a worker must have sent a heartbeat to
// show in the overview (workers beat every HEARTBEAT_INTERVAL, 5 s by
// default; maintenance drops silent ones after WORKER_DEAD_AFTER, 1 min by
// default).
const workerLiveWithin = time.Minute

// handleOverview answers the caller's org at a glance: tasks per status,
// the last hour, the queues per type, the outbox, and the deployment's
// workers with the caller's tasks each runs. Callers who would see the
// same overview share it (overview_share.go); as_of says when it was read.
func (s *server) handleOverview() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		p := principal(r)
		v, err := s.overviews.get(r.Context(), overviewKey(p), s.cfg.RequestTimeout,
			func(ctx context.Context) (overviewView, error) {
				var fleet registry.Fleet
				if s.Workers != nil {
					var err error
					if fleet, err = s.Workers.Fleet(ctx, workerLiveWithin); err != nil {
						return overviewView{}, err
					}
				}
				ids := make([]string, len(fleet.Workers))
				for i, wk := range fleet.Workers {
					ids[i] = wk.ID
				}
				o, err := s.Store.Overview(ctx, p, ids)
				if err != nil {
					return overviewView{}, err
				}
				return toOverviewView(o, fleet), nil
			})
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, v)
	}
}

// overviewView is the JSON shape of GET /v1/overview.
type overviewView struct {
	// AsOf is when the overview was read: callers who would see the same
	// one share it, and a costly one is handed out again for a few
	// seconds.
	AsOf time.Time `json:"as_of"`
	// Counts has every status, 0 when no task is in it.
	Counts   map[task.Status]int `json:"counts"`
	LastHour lastHourView        `json:"last_hour"`
	Types    []queueView         `json:"types"`
	Outbox   outboxView          `json:"outbox"`
	Workers  []workerView        `json:"workers"`
	// Leader is the id of the worker leading maintenance; null when none
	// does.
	Leader *string `json:"leader"`
}

type lastHourView struct {
	Minutes             []minuteView `json:"minutes"`
	Completed           int          `json:"completed"`
	Failed              int          `json:"failed"`
	ThroughputPerMinute float64      `json:"throughput_per_minute"`
}

type minuteView struct {
	Minute    time.Time `json:"minute"`
	Completed int       `json:"completed"`
	Failed    int       `json:"failed"`
}

type queueView struct {
	Type                    string  `json:"type"`
	Pending                 int     `json:"pending"`
	Scheduled               int     `json:"scheduled"`
	Running                 int     `json:"running"`
	OldestPendingAgeSeconds float64 `json:"oldest_pending_age_seconds"`
}

type outboxView struct {
	Depth            int64   `json:"depth"`
	OldestAgeSeconds float64 `json:"oldest_age_seconds"`
	Parked           int64   `json:"parked"`
}

type workerView struct {
	ID              string        `json:"id"`
	Hostname        string        `json:"hostname"`
	Types           []string      `json:"types"`
	Concurrency     int           `json:"concurrency"`
	Version         string        `json:"version"`
	LastHeartbeatAt time.Time     `json:"last_heartbeat_at"`
	Running         []runningView `json:"running"`
}

type runningView struct {
	ID   string `json:"id"`
	Type string `json:"type"`
}

// toOverviewView converts an overview and the fleet to their JSON shape.
func toOverviewView(o task.Overview, fleet registry.Fleet) overviewView {
	v := overviewView{Counts: map[task.Status]int{}, Types: make([]queueView, len(o.Types)),
		Workers:  make([]workerView, len(fleet.Workers)),
		LastHour: lastHourView{Minutes: make([]minuteView, len(o.Minutes))},
		Outbox: outboxView{Depth: o.Outbox.Due, OldestAgeSeconds: o.Outbox.OldestDueAge.Seconds(),
			Parked: o.Outbox.Parked}}
	for _, st := range task.Statuses {
		v.Counts[st] = o.Counts[st]
	}
	for i, m := range o.Minutes {
		v.LastHour.Minutes[i] = minuteView{Minute: m.Start.UTC(), Completed: m.Completed, Failed: m.Failed}
		v.LastHour.Completed += m.Completed
		v.LastHour.Failed += m.Failed
	}
	v.LastHour.ThroughputPerMinute = float64(v.LastHour.Completed) / 60
	for i, q := range o.Types {
		v.Types[i] = queueView{Type: q.Type, Pending: q.Pending, Scheduled: q.Scheduled, Running: q.Running,
			OldestPendingAgeSeconds: q.OldestPendingAge.Seconds()}
	}
	for i, wk := range fleet.Workers {
		running := make([]runningView, len(o.Running[wk.ID]))
		for j, t := range o.Running[wk.ID] {
			running[j] = runningView{ID: t.ID.String(), Type: t.Type}
		}
		v.Workers[i] = workerView{ID: wk.ID, Hostname: wk.Hostname, Types: wk.Types, Concurrency: wk.Concurrency,
			Version: wk.Version, LastHeartbeatAt: wk.LastHeartbeatAt.UTC(), Running: running}
	}
	if fleet.Leader != "" {
		v.Leader = &fleet.Leader
	}
	return v
}
