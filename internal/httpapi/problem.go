package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"strings"

	"github.com/go-chi/chi/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/job"
	"github.com/conveyorhq/conveyor/internal/task"
)

// statusOf is THE table from domain error codes to HTTP statuses.
var statusOf = map[task.Code]int{
	task.ErrCodeMalformed:           http.StatusBadRequest,
	task.ErrCodeUnsupportedMedia:    http.StatusUnsupportedMediaType,
	task.ErrCodeTooLarge:            http.StatusRequestEntityTooLarge,
	task.ErrCodeInvalid:             http.StatusUnprocessableEntity,
	task.ErrCodeIdempotencyMismatch: http.StatusUnprocessableEntity,
	task.ErrCodeNotFound:            http.StatusNotFound,
	task.ErrCodeConflict:            http.StatusConflict,
	task.ErrCodeForbidden:           http.StatusForbidden,
	task.ErrCodeUnavailable:         http.StatusServiceUnavailable,
	task.ErrCodeInternal:            http.StatusInternalServerError,
}

// statusClientClosed is nginx's status for a request whose client left
// before its answer: recorded, never received.
const statusClientClosed = 499

// problem is an RFC 9457 problem document.
type problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	// Field names the input at fault, for validation errors.
	Field    string `json:"field,omitempty"`
	Instance string `json:"instance,omitempty"`
	// Matched is how many tasks a bulk action's filter matches now, when
	// that is more than the request expected (an extension member).
	Matched *int `json:"matched,omitempty"`
	// Errors lists every mistake of a jobs file, with its line.
	Errors job.Problems `json:"errors,omitempty"`
}

// writeError answers with the problem document for err. Errors that are not
// *task.Error are internal: logged, and hidden from the client.
func (s *server) writeError(w http.ResponseWriter, r *http.Request, err error) {
	s.writeErrorWith(w, r, err, nil)
}

// writeErrorWith is writeError with extend, when not nil, adding extension
// members to the document.
func (s *server) writeErrorWith(w http.ResponseWriter, r *http.Request, err error, extend func(*problem)) {
	if errors.Is(r.Context().Err(), context.Canceled) {
		// The client closed the connection (a request's own deadline is
		// DeadlineExceeded): whatever failed, failed for that, no one
		// reads the answer, and it is no fault of the server's to count
		// as a 5xx or log as an error. nginx's 499 records it.
		s.Log.DebugContext(r.Context(), "client closed the request", "method", r.Method, "path", r.URL.Path, "error", err)
		w.WriteHeader(statusClientClosed)
		return
	}
	var e *task.Error
	if !errors.As(err, &e) {
		s.Log.ErrorContext(r.Context(), "request failed", "method", r.Method, "path", r.URL.Path, "error", err)
		e = &task.Error{Code: task.ErrCodeInternal, Message: "internal error"}
	}
	status, ok := statusOf[e.Code]
	if !ok {
		status = http.StatusInternalServerError
	}
	if status >= http.StatusInternalServerError {
		// The tracing middleware marks the span of a 5xx failed, with no
		// reason; the client of an internal error is told none either.
		trace.SpanFromContext(r.Context()).RecordError(err)
	}
	p := problem{
		Type:     "urn:conveyor:problem:" + string(e.Code),
		Title:    http.StatusText(status),
		Status:   status,
		Detail:   e.Error(),
		Field:    e.Field,
		Instance: r.URL.Path,
	}
	if e.Message != "" {
		p.Detail = e.Message
		if e.Field != "" {
			p.Detail = e.Field + ": " + e.Message
		}
	}
	if extend != nil {
		extend(&p)
	}
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	if err := json.NewEncoder(w).Encode(p); err != nil {
		s.Log.DebugContext(r.Context(), "write problem", slog.Any("error", err))
	}
}

func (s *server) handleNotFound() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s.writeError(w, r, task.Errorf(task.ErrCodeNotFound, "no route for %s %s", r.Method, r.URL.Path))
	}
}

// routeMethods are the methods the API's routes are served for.
var routeMethods = []string{http.MethodGet, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete}

// handleMethodNotAllowed answers 405 with the Allow header a 405 must
// carry (RFC 9110): the methods the router serves the path with. chi sets it
// only in its own 405 handler, which this one replaces.
func (s *server) handleMethodNotAllowed(routes chi.Routes) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		path := r.URL.RawPath
		if path == "" {
			path = r.URL.Path
		}
		var allowed []string
		for _, m := range routeMethods {
			if routes.Match(chi.NewRouteContext(), m, path) {
				allowed = append(allowed, m)
				if m == http.MethodGet {
					allowed = append(allowed, http.MethodHead)
				}
			}
		}
		p := problem{
			Type: "urn:conveyor:problem:method_not_allowed", Title: http.StatusText(http.StatusMethodNotAllowed),
			Status: http.StatusMethodNotAllowed, Detail: r.Method + " is not allowed on " + r.URL.Path, Instance: r.URL.Path,
		}
		w.Header().Set("Allow", strings.Join(allowed, ", "))
		w.Header().Set("Content-Type", "application/problem+json")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.WriteHeader(http.StatusMethodNotAllowed)
		_ = json.NewEncoder(w).Encode(p)
	}
}
