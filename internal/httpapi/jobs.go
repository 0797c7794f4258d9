package httpapi

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"net/http"
	"strconv"
	"time"

	"github.com/go-chi/chi/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/job"
	"github.com/conveyorhq/conveyor/internal/task"
)

// JobStore is what the API needs of the database for jobs, type limits and
// pauses; like Store, every call acts within the principal's org.
type JobStore interface {
	Jobs(ctx context.Context, p auth.Principal) ([]job.Stored, error)
	Job(ctx context.Context, p auth.Principal, name string) (job.Stored, error)
	TypeLimits(ctx context.Context, p auth.Principal) ([]job.TypeState, error)
	Apply(ctx context.Context, p auth.Principal, file job.File, dryRun, prune bool) ([]job.Change, error)
	PauseJob(ctx context.Context, p auth.Principal, name string, pause bool) error
	PauseType(ctx context.Context, p auth.Principal, typ string, pause bool) error
	Trigger(ctx context.Context, p auth.Principal, name string, payload json.RawMessage, key string, trace task.Carrier) (task.Task, error)
}

// jobView is the JSON shape of a job: its definition and its state.
type jobView struct {
	ID string `json:"id"`
	job.Definition
	ConfigHash string     `json:"config_hash"`
	Paused     bool       `json:"paused"`
	PausedAt   *time.Time `json:"paused_at,omitempty"`
	NextTickAt *time.Time `json:"next_tick_at,omitempty"`
	CreatedAt  time.Time  `json:"created_at"`
	UpdatedAt  time.Time  `json:"updated_at"`
}

func toJobView(j job.Stored) jobView {
	v := jobView{ID: j.ID.String(), Definition: j.Definition, ConfigHash: j.ConfigHash, Paused: j.PausedAt != nil,
		PausedAt: j.PausedAt, CreatedAt: j.CreatedAt, UpdatedAt: j.UpdatedAt}
	if j.Definition.Source != nil && j.Definition.Active && j.PausedAt == nil {
		v.NextTickAt = j.NextTickAt
	}
	return v
}

type typeStateView struct {
	job.TypeLimit
	Paused   bool       `json:"paused"`
	PausedAt *time.Time `json:"paused_at,omitempty"`
}

func (s *server) handleListJobs() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		jobs, err := s.Jobs.Jobs(r.Context(), principal(r))
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, map[string]any{"jobs": mapSlice(jobs, toJobView)})
	}
}

func (s *server) handleGetJob() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		j, err := s.Jobs.Job(r.Context(), principal(r), chi.URLParam(r, "name"))
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, toJobView(j))
	}
}

func (s *server) handleListTypes() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		types, err := s.Jobs.TypeLimits(r.Context(), principal(r))
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, map[string]any{"types": mapSlice(types, func(t job.TypeState) typeStateView {
			return typeStateView{TypeLimit: t.TypeLimit, Paused: t.PausedAt != nil, PausedAt: t.PausedAt}
		})})
	}
}

// handleApplyJobs applies a jobs file (YAML, or JSON) to the org: the
// answer lists what changed, or with dry_run what would. A file with any
// mistake changes nothing and answers 422 with every mistake and its line.
func (s *server) handleApplyJobs() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		dryRun, err := boolParam(r, "dry_run")
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		prune, err := boolParam(r, "prune")
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
		switch mt {
		case "application/yaml", "application/x-yaml", "text/yaml", "application/json":
		default:
			s.writeError(w, r, task.Errorf(task.ErrCodeUnsupportedMedia,
				"Content-Type must be application/yaml or application/json, got %q", r.Header.Get("Content-Type")))
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
		if err != nil {
			var tooLarge *http.MaxBytesError
			if errors.As(err, &tooLarge) {
				s.writeError(w, r, task.Errorf(task.ErrCodeTooLarge, "body exceeds %d bytes", s.cfg.MaxBodyBytes))
				return
			}
			s.writeError(w, r, task.Errorf(task.ErrCodeMalformed, "reading the body: %v", err))
			return
		}
		if len(bytes.TrimSpace(body)) == 0 {
			// No body at all is a request that lost its file, not one that
			// declares nothing: with prune it would delete every job. So is
			// one of white space alone, which is what `echo "$FILE"` or a
			// template sends when its file is missing. A file that declares
			// nothing says so ({}, or a comment).
			s.writeError(w, r, task.Errorf(task.ErrCodeMalformed,
				"request body is empty: send the file (one that declares nothing is {})"))
			return
		}
		file, err := job.Parse(body)
		var problems job.Problems
		if errors.As(err, &problems) {
			s.writeErrorWith(w, r, task.Invalid("", "%s", problems.Error()), func(p *problem) {
				p.Detail = "the file has " + strconv.Itoa(len(problems)) + " mistake(s); nothing was applied"
				p.Errors = problems
			})
			return
		}
		if err != nil {
			s.writeError(w, r, task.Invalid("", "%v", err))
			return
		}
		changes, err := s.Jobs.Apply(r.Context(), principal(r), file, dryRun, prune)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		if changes == nil {
			changes = []job.Change{}
		}
		s.respond(w, r, http.StatusOK, map[string]any{"dry_run": dryRun, "changes": changes})
	}
}

func boolParam(r *http.Request, name string) (bool, error) {
	v := r.URL.Query().Get(name)
	if v == "" {
		return false, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, task.Invalid(name, "must be true or false, got %q", v)
	}
	return b, nil
}

func (s *server) handlePauseJob(pause bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		name := chi.URLParam(r, "name")
		if err := s.Jobs.PauseJob(r.Context(), principal(r), name, pause); err != nil {
			s.writeError(w, r, err)
			return
		}
		j, err := s.Jobs.Job(r.Context(), principal(r), name)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, toJobView(j))
	}
}

func (s *server) handlePauseType(pause bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		typ := chi.URLParam(r, "type")
		if err := s.Jobs.PauseType(r.Context(), principal(r), typ, pause); err != nil {
			s.writeError(w, r, err)
			return
		}
		view := typeStateView{TypeLimit: job.TypeLimit{Type: typ}}
		types, err := s.Jobs.TypeLimits(r.Context(), principal(r))
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		for _, t := range types {
			if t.Type == typ {
				view = typeStateView{TypeLimit: t.TypeLimit, Paused: t.PausedAt != nil, PausedAt: t.PausedAt}
			}
		}
		s.respond(w, r, http.StatusOK, view)
	}
}

// handleTriggerJob makes a task of a job now.
func (s *server) handleTriggerJob() http.HandlerFunc {
	type request struct {
		Payload        json.RawMessage `json:"payload"`
		ConcurrencyKey string          `json:"concurrency_key"`
	}
	return func(w http.ResponseWriter, r *http.Request) {
		if err := noKeyHeader(r, "a trigger takes no idempotency key: each call makes a task"); err != nil {
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
		t, err := s.Jobs.Trigger(r.Context(), principal(r), chi.URLParam(r, "name"), req.Payload, req.ConcurrencyKey, s.carrier(r))
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.metrics.submitted(s.types.label(t.Type), true)
		// The task runs in this request's trace, as a submitted one does.
		trace.SpanFromContext(r.Context()).SetAttributes(attribute.String("conveyor.task_id", t.ID.String()))
		w.Header().Set("Location", "/v1/tasks/"+t.ID.String())
		s.respond(w, r, http.StatusCreated, s.toTaskView(t))
	}
}
