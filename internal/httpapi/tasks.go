package httpapi

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
)

// submitRequest is the body of POST /v1/tasks.
type submitRequest struct {
	Type        string          `json:"type"`
	Payload     json.RawMessage `json:"payload"`
	Priority    *int            `json:"priority"`
	Metadata    json.RawMessage `json:"metadata"`
	MaxAttempts *int            `json:"max_attempts"`
	Dedupe      *bool           `json:"dedupe"`
	Visibility  []string        `json:"visibility"`
	RunAt       *jsonTime       `json:"run_at"`
	Delay       string          `json:"delay"`
	// ConcurrencyKey divides the type's per-key limit; the timeouts
	// bound each attempt and the time between its heartbeats.
	ConcurrencyKey          string `json:"concurrency_key"`
	TimeoutSeconds          int    `json:"timeout_seconds"`
	HeartbeatTimeoutSeconds int    `json:"heartbeat_timeout_seconds"`
}

// batchEntry is one entry of POST /v1/tasks/batch; it carries its own
// idempotency key where a single submit uses the header.
type batchEntry struct {
	submitRequest
	IdempotencyKey string `json:"idempotency_key"`
}

func toSubmitInput(req submitRequest, key string) task.SubmitInput {
	var runAt *time.Time
	if req.RunAt != nil {
		runAt = &req.RunAt.Time
	}
	return task.SubmitInput{Type: req.Type, Payload: req.Payload, Priority: req.Priority,
		Metadata: req.Metadata, MaxAttempts: req.MaxAttempts, Dedupe: req.Dedupe, IdempotencyKey: key,
		Visibility: req.Visibility, RunAt: runAt, Delay: req.Delay, ConcurrencyKey: req.ConcurrencyKey,
		TimeoutSeconds: req.TimeoutSeconds, HeartbeatTimeoutSeconds: req.HeartbeatTimeoutSeconds}
}

func (s *server) handleSubmit() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req submitRequest
		if err := s.decode(w, r, &req); err != nil {
			s.writeError(w, r, err)
			return
		}
		key, err := oneHeader(r, "Idempotency-Key")
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		if _, present := r.Header["Idempotency-Key"]; present && key == "" {
			s.writeError(w, r, task.Invalid("Idempotency-Key", "must not be empty"))
			return
		}
		sub, err := task.NewSubmission(toSubmitInput(req, key), s.cfg.Defaults, "")
		if e, ok := errors.AsType[*task.Error](err); ok && e.Field == "idempotency_key" {
			// A single submission's key is its header.
			err = task.Invalid("Idempotency-Key", "%s", e.Message)
		}
		if err == nil {
			err = mayRestrict(principal(r), sub, "")
		}
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		if err := s.admitTypes(r, []task.Submission{sub}); err != nil {
			s.writeError(w, r, err)
			return
		}
		res, err := s.Store.Submit(r.Context(), principal(r), sub, s.carrier(r))
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.metrics.submitted(s.types.label(sub.Type), res.Created)
		span := trace.SpanFromContext(r.Context())
		span.SetAttributes(attribute.String("conveyor.task_id", res.Task.ID.String()),
			attribute.Bool("conveyor.duplicate", !res.Created))
		linkOriginal(span, res)
		w.Header().Set("Location", "/v1/tasks/"+res.Task.ID.String())
		status := http.StatusOK
		if res.Created {
			status = http.StatusCreated
		}
		s.respond(w, r, status, s.toTaskView(res.Task))
	}
}

func (s *server) handleSubmitBatch() http.HandlerFunc {
	type request struct {
		Tasks []batchEntry `json:"tasks"`
	}
	type entry struct {
		Result string   `json:"result"`
		Task   taskView `json:"task"`
	}
	type response struct {
		Results []entry `json:"results"`
	}
	return func(w http.ResponseWriter, r *http.Request) {
		var req request
		if err := s.decode(w, r, &req); err != nil {
			s.writeError(w, r, err)
			return
		}
		if err := noKeyHeader(r, "a batch takes no header key: give each entry its own idempotency_key"); err != nil {
			s.writeError(w, r, err)
			return
		}
		if len(req.Tasks) == 0 || len(req.Tasks) > task.MaxBatchSize {
			s.writeError(w, r, task.Invalid("tasks", "must hold 1 to %d tasks, got %d", task.MaxBatchSize, len(req.Tasks)))
			return
		}
		subs := make([]task.Submission, len(req.Tasks))
		stored := 0
		for i, item := range req.Tasks {
			field := fmt.Sprintf("tasks[%d].", i)
			sub, err := task.NewSubmission(toSubmitInput(item.submitRequest, item.IdempotencyKey), s.cfg.Defaults, field)
			if err == nil {
				err = mayRestrict(principal(r), sub, field)
			}
			if err != nil {
				s.writeError(w, r, err)
				return
			}
			subs[i] = sub
			if stored += sub.StoredBytes; stored > task.MaxBatchStoredBytes {
				s.writeError(w, r, task.Invalid("tasks", "the payloads and metadata of tasks[0] to tasks[%d] take %d bytes as stored, "+
					"more than the limit of %d for a batch: send fewer tasks per batch", i, stored, task.MaxBatchStoredBytes))
				return
			}
		}
		if err := s.admitTypes(r, subs); err != nil {
			s.writeError(w, r, err)
			return
		}
		results, err := s.Store.SubmitBatch(r.Context(), principal(r), subs, s.carrier(r))
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		resp := response{Results: make([]entry, len(results))}
		for i, res := range results {
			resp.Results[i] = entry{Result: "duplicate", Task: s.toTaskView(res.Task)}
			if res.Created {
				resp.Results[i].Result = "created"
			}
			s.metrics.submitted(s.types.label(subs[i].Type), res.Created)
			linkOriginal(trace.SpanFromContext(r.Context()), res)
		}
		s.respond(w, r, http.StatusOK, resp)
	}
}

func (s *server) handleGet() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id, err := taskID(r)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		t, err := s.Store.Get(r.Context(), principal(r), id)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, s.toTaskView(t))
	}
}

const (
	defaultListLimit   = 50
	maxListLimit       = 500
	defaultEventsLimit = 50
	maxEventsLimit     = 100
)

func (s *server) handleList() http.HandlerFunc {
	type response struct {
		Tasks      []taskSummary `json:"tasks"`
		NextCursor string        `json:"next_cursor,omitempty"`
	}
	return func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		filter, err := toFilter(filterInput{Status: q.Get("status"), Type: q.Get("type"),
			CreatedAfter: q.Get("created_after"), CreatedBefore: q.Get("created_before"), Q: q.Get("q")}, "")
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		f := task.ListFilter{Filter: filter}
		if f.Limit, err = limitParam(q, defaultListLimit, maxListLimit); err != nil {
			s.writeError(w, r, err)
			return
		}
		if c := q.Get("cursor"); c != "" {
			if f.After, err = decodeCursor(c); err != nil {
				s.writeError(w, r, err)
				return
			}
		}
		// One row more than the page says whether another page follows: a
		// full last page has no cursor, whose page would come back empty.
		limit := f.Limit
		f.Limit++
		tasks, err := s.Store.List(r.Context(), principal(r), f)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		tasks, next := pageOf(tasks, limit, func(t task.Task) string { return encodeCursor(t.ID) })
		resp := response{Tasks: toTaskSummaries(tasks), NextCursor: next}
		s.respond(w, r, http.StatusOK, resp)
	}
}

func (s *server) handleEvents() http.HandlerFunc {
	type response struct {
		Events     []eventView `json:"events"`
		NextCursor string      `json:"next_cursor,omitempty"`
	}
	return func(w http.ResponseWriter, r *http.Request) {
		id, err := taskID(r)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		q := r.URL.Query()
		limit, err := limitParam(q, defaultEventsLimit, maxEventsLimit)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		var before int64
		if c := q.Get("cursor"); c != "" {
			if before, err = decodeEventCursor(c); err != nil {
				s.writeError(w, r, err)
				return
			}
		}
		// One event more than the page says whether older ones remain.
		events, err := s.Store.Events(r.Context(), principal(r), id, limit+1, before)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		events, next := pageOf(events, limit, func(e task.Event) string { return encodeEventCursor(e.ID) })
		resp := response{Events: toEventViews(events), NextCursor: next}
		s.respond(w, r, http.StatusOK, resp)
	}
}

func (s *server) handleCancel() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id, err := taskID(r)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		t, outcome, err := s.Store.Cancel(r.Context(), principal(r), id, s.carrier(r))
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		status := http.StatusOK
		if outcome == task.CancelRequested {
			status = http.StatusAccepted
		}
		s.respond(w, r, status, s.toTaskView(t))
	}
}

func (s *server) handleRetry() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id, err := taskID(r)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		t, err := s.Store.Retry(r.Context(), principal(r), id, s.carrier(r))
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		// The task runs again in this request's trace.
		trace.SpanFromContext(r.Context()).SetAttributes(attribute.String("conveyor.task_id", t.ID.String()))
		s.respond(w, r, http.StatusOK, s.toTaskView(t))
	}
}

// admitTypes asks the store to bound the org's unserved task types when a
// submission names a type no worker was known to serve (the common case,
// known types only, costs no query).
func (s *server) admitTypes(r *http.Request, subs []task.Submission) error {
	if s.cfg.MaxUnservedTypes <= 0 {
		return nil
	}
	var unknown []task.Submission
	for _, sub := range subs {
		if s.types.label(sub.Type) == otherType {
			unknown = append(unknown, sub)
		}
	}
	if len(unknown) == 0 {
		return nil
	}
	return s.Store.AdmitTypes(r.Context(), principal(r), unknown, s.cfg.MaxUnservedTypes)
}

// mayRestrict refuses a submission restricted to org roles the caller
// does not hold: whoever submits a task must be able to see it.
func mayRestrict(p auth.Principal, sub task.Submission, field string) error {
	if p.MayRestrictTo(sub.Visibility) {
		return nil
	}
	return &task.Error{Code: task.ErrCodeForbidden, Field: field + "visibility",
		Message: "a task may be restricted only to org roles its submitter holds"}
}

// linkOriginal links a request's span to the trace of a duplicate's task:
// that task runs in the trace of the request that made it, which the
// duplicate request's own trace would otherwise never lead to.
func linkOriginal(span trace.Span, res task.Submitted) {
	if res.Created || !span.IsRecording() {
		return
	}
	ctx := propagation.TraceContext{}.Extract(context.Background(),
		propagation.MapCarrier{"traceparent": res.Task.Traceparent})
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() || sc.TraceID() == span.SpanContext().TraceID() {
		return
	}
	span.AddLink(trace.Link{SpanContext: sc, Attributes: []attribute.KeyValue{
		attribute.String("conveyor.link", "original submission"),
		attribute.String("conveyor.task_id", res.Task.ID.String()),
	}})
}

// carrier captures the trace context of the request's own span (never the
// caller's baggage) for the task and its outbox message.
func (s *server) carrier(r *http.Request) task.Carrier {
	c := task.Carrier{}
	propagation.TraceContext{}.Inject(r.Context(), propagation.MapCarrier(c))
	return c
}

// noKeyHeader refuses an Idempotency-Key on a route that does not honour
// one: ignored, it would let a client that retries believe its retries
// safe while each made another task. why says what to do instead.
func noKeyHeader(r *http.Request, why string) error {
	if _, present := r.Header["Idempotency-Key"]; present {
		return task.Invalid("Idempotency-Key", "%s", why)
	}
	return nil
}

// oneHeader is the value of a header that holds one: given twice, even
// with one value, the request is ambiguous, and refused as a query
// parameter given twice is.
func oneHeader(r *http.Request, name string) (string, error) {
	if n := len(r.Header.Values(name)); n > 1 {
		return "", task.Errorf(task.ErrCodeMalformed, "header %s given %d times", name, n)
	}
	return r.Header.Get(name), nil
}

func taskID(r *http.Request) (uuid.UUID, error) {
	raw := chi.URLParam(r, "id")
	id, err := uuid.Parse(raw)
	if err != nil || len(raw) != 36 {
		return uuid.Nil, task.Errorf(task.ErrCodeMalformed, "task id %q is not a UUID", raw)
	}
	return id, nil
}

func limitParam(q url.Values, def, max int) (int, error) {
	raw := q.Get("limit")
	if raw == "" {
		return def, nil
	}
	n, err := strconv.Atoi(raw)
	if err != nil || n < 1 || n > max {
		return 0, task.Invalid("limit", "must be an integer from 1 to %d, got %q", max, raw)
	}
	return n, nil
}

// statusAndType reads the status and type filters of a listing, a stream
// or a bulk action; empty means any. prefix leads the name of the field at
// fault.
func statusAndType(rawStatus, typ, prefix string) (task.Status, string, error) {
	status := task.Status(rawStatus)
	if status != "" && !status.Valid() {
		return "", "", task.Invalid(prefix+"status", "must be one of %v", task.Statuses)
	}
	if typ != "" {
		if err := task.ValidateType(typ); err != nil {
			err.Field = prefix + err.Field
			return "", "", err
		}
	}
	return status, typ, nil
}

// filterInput is a task filter as a client writes it: the query parameters
// of a listing, the "filter" object of a bulk action. Empty fields do not
// filter.
type filterInput struct {
	Status string `json:"status"`
	Type   string `json:"type"`
	// CreatedAfter (inclusive) and CreatedBefore (exclusive) are RFC 3339
	// times.
	CreatedAfter  string `json:"created_after"`
	CreatedBefore string `json:"created_before"`
	// Q is a task id, or key=value: the tasks whose metadata holds the key
	// with that value (as text).
	Q string `json:"q"`
}

// Bounds of a metadata search (q=key=value).
const (
	maxSearchKey   = 255
	maxSearchValue = 1024
)

// toFilter checks a filter and converts it to the domain's; prefix leads
// the names of the fields at fault.
func toFilter(in filterInput, prefix string) (task.Filter, error) {
	status, typ, err := statusAndType(in.Status, in.Type, prefix)
	if err != nil {
		return task.Filter{}, err
	}
	f := task.Filter{Status: status, Type: typ}
	if f.CreatedAfter, err = timeParam(in.CreatedAfter, prefix+"created_after"); err != nil {
		return task.Filter{}, err
	}
	if f.CreatedBefore, err = timeParam(in.CreatedBefore, prefix+"created_before"); err != nil {
		return task.Filter{}, err
	}
	if !f.CreatedAfter.IsZero() && !f.CreatedBefore.IsZero() && !f.CreatedAfter.Before(f.CreatedBefore) {
		return task.Filter{}, task.Invalid(prefix+"created_before", "must be later than created_after")
	}
	switch key, value, isPair := strings.Cut(in.Q, "="); {
	case in.Q == "":
	case len(in.Q) == 36 && uuid.Validate(in.Q) == nil:
		f.ID = uuid.MustParse(in.Q)
	case isPair && key != "":
		if len(key) > maxSearchKey || len(value) > maxSearchValue || !utf8.ValidString(in.Q) || strings.ContainsRune(in.Q, 0) {
			return task.Filter{}, task.Invalid(prefix+"q", "a metadata key=value must be valid text, without NUL, "+
				"its key at most %d bytes and its value at most %d", maxSearchKey, maxSearchValue)
		}
		f.MetaKey, f.MetaValue = key, value
	default:
		return task.Filter{}, task.Invalid(prefix+"q", "must be a task id (a UUID) or a metadata key=value, got %q", in.Q)
	}
	return f, nil
}

// timeParam reads an RFC 3339 time; empty is the zero time.
func timeParam(raw, field string) (time.Time, error) {
	if raw == "" {
		return time.Time{}, nil
	}
	t, err := time.Parse(time.RFC3339Nano, raw)
	if err != nil {
		return time.Time{}, task.Invalid(field, "must be an RFC 3339 time such as 2026-01-02T15:04:05Z, got %q", raw)
	}
	if t.IsZero() {
		// A filter keeps an absent bound as the zero time, so this one
		// would bound nothing: created_before would select every task.
		return time.Time{}, task.Invalid(field, "must be later than 0001-01-01T00:00:00Z, got %q", raw)
	}
	return t, nil
}

// Cursors are opaque to clients: the last id of a page, base64url encoded.
// pageOf cuts rows, read one past limit, to limit, and returns the cursor
// of the next page: "" when no row lay past it, since a full last page's
// cursor would read an empty one.
func pageOf[T any](rows []T, limit int, cursor func(T) string) ([]T, string) {
	if len(rows) <= limit {
		return rows, ""
	}
	rows = rows[:limit]
	return rows, cursor(rows[limit-1])
}

func encodeCursor(id uuid.UUID) string { return base64.RawURLEncoding.EncodeToString(id[:]) }

func decodeCursor(c string) (uuid.UUID, error) {
	b, err := base64.RawURLEncoding.DecodeString(c)
	if err != nil || len(b) != 16 {
		return uuid.Nil, task.Invalid("cursor", "is not a cursor this API returned")
	}
	return uuid.UUID(b), nil
}

// An events cursor is the id of the last event of a page, as 8 bytes, so
// that a listing's cursor (16) is never taken for one.
func encodeEventCursor(id int64) string {
	return base64.RawURLEncoding.EncodeToString(binary.BigEndian.AppendUint64(nil, uint64(id)))
}

func decodeEventCursor(c string) (int64, error) {
	b, err := base64.RawURLEncoding.DecodeString(c)
	if err != nil || len(b) != 8 || int64(binary.BigEndian.Uint64(b)) <= 0 {
		return 0, task.Invalid("cursor", "is not a cursor this API returned")
	}
	return int64(binary.BigEndian.Uint64(b)), nil
}
