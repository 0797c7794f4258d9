package httpapi

import (
	"net/http"

	"github.com/conveyorhq/conveyor/internal/task"
)

// bulkRequest is the body of POST /v1/tasks/cancel and /v1/tasks/retry.
type bulkRequest struct {
	Filter filterInput `json:"filter"`
	DryRun bool        `json:"dry_run"`
	// Expected is the count the person confirmed (a dry run's matched).
	Expected *int `json:"expected"`
	Limit    *int `json:"limit"`
}

// bulkResponse is the answer of a bulk action: matched alone for a dry
// run; with what was done, under the action's own name, otherwise.
type bulkResponse struct {
	Matched   int   `json:"matched"`
	Cancelled *int  `json:"cancelled,omitempty"`
	Retried   *int  `json:"retried,omitempty"`
	Skipped   *int  `json:"skipped,omitempty"`
	More      *bool `json:"more,omitempty"`
}

// handleBulk applies action to every task the body's filter matches (up to
// its limit), or counts them.
func (s *server) handleBulk(action task.Action) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req bulkRequest
		if err := s.decode(w, r, &req); err != nil {
			s.writeError(w, r, err)
			return
		}
		b, err := toBulk(action, req)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		res, err := s.Store.Bulk(r.Context(), principal(r), b, s.carrier(r))
		if err != nil {
			if task.ErrorCode(err) == task.ErrCodeConflict {
				s.writeErrorWith(w, r, err, func(p *problem) { p.Matched = &res.Matched })
				return
			}
			s.writeError(w, r, err)
			return
		}
		resp := bulkResponse{Matched: res.Matched}
		if !b.DryRun {
			s.overviews.forget(principal(r).OrgID)
			resp.Skipped, resp.More = &res.Skipped, &res.More
			if action == task.ActionCancel {
				resp.Cancelled = &res.Changed
			} else {
				resp.Retried = &res.Changed
			}
		}
		s.respond(w, r, http.StatusOK, resp)
	}
}

// toBulk checks a bulk request and converts it to the domain's.
func toBulk(action task.Action, req bulkRequest) (task.Bulk, error) {
	f, err := toFilter(req.Filter, "filter.")
	if err != nil {
		return task.Bulk{}, err
	}
	if _, err := action.Narrow(f.Status); err != nil {
		return task.Bulk{}, err
	}
	b := task.Bulk{Action: action, Filter: f, DryRun: req.DryRun, Expected: req.Expected, Limit: task.MaxBulkLimit}
	if req.Expected != nil && *req.Expected < 0 {
		return task.Bulk{}, task.Invalid("expected", "must be 0 or more, got %d", *req.Expected)
	}
	if req.Limit != nil {
		if *req.Limit < 1 || *req.Limit > task.MaxBulkLimit {
			return task.Bulk{}, task.Invalid("limit", "must be from 1 to %d, got %d", task.MaxBulkLimit, *req.Limit)
		}
		b.Limit = *req.Limit
	}
	return b, nil
}
